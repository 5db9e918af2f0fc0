"""Dagster resources: storage, the Ray connection, the sources file and the models.

The captioner and classifier settings are declared once, on their specs (CaptionerSpec,
LabelerSpec); the resources take those fields from the specs and add only what belongs to
the Dagster side (where the API key comes from, commit size, schedule, active version)."""


import dataclasses
import os
import typing
from collections.abc import Iterable
from pathlib import Path

import dagster as dg
import yaml
from pydantic import PrivateAttr

from prx_assets.engine import ray_runtime
from prx_assets.stages.captions.captioners import CaptionerSpec
from prx_assets.stages.ingest.sources import SourcesConfig, load_sources, sources_path
from prx_assets.stages.labels.backends import DEFAULT_LLM, OpenAISettings, VLLMSettings
from prx_assets.stages.labels.runs import LabelerSpec
from prx_assets.stages.report.cost import DEFAULT_CPU_HOUR_USD, DEFAULT_GPU_HOUR_USD
from prx_assets.storage.layout import Storage
from prx_assets.storage.object_store import SECRET_KEYS

# Setting names (and object_store's aliases of them) that hold credentials.
SECRET_SETTINGS = SECRET_KEYS | {"access_key_id", "secret_access_key", "session_token",
                                 "token", "aws_token"}


class StorageResource(dg.ConfigurableResource):
    """Where the corpus lives: `root`, or `$PRX_DATA_ROOT` (default ./data) when unset.

    Read at run time, not at definition time, so one code location serves any root. On an
    object store (`s3://bucket/prefix`) the standard AWS variables give the endpoint and
    credentials; `object_store` overrides settings that are not secret (Lance's key names:
    `aws_endpoint`, `aws_region`, `allow_http`, `timeout`, ...). Credentials are refused
    here: resource config is shown in the Dagster UI, so they come from the environment."""

    root: str | None = None
    object_store: dict[str, str] | None = None

    def get(self) -> Storage:
        secret = sorted(set(self.object_store or {}) & SECRET_SETTINGS)
        if secret:
            raise ValueError(
                f"StorageResource.object_store must not hold credentials ({', '.join(secret)}): "
                "set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN in the "
                "environment instead (resource config is shown in the Dagster UI)")
        return Storage(self.root or Storage.from_env().root, self.object_store)


class RayResource(dg.ConfigurableResource):
    """Embedded local Ray unless `address` (or the RAY_ADDRESS env var) names a cluster."""

    address: str | None = None
    num_cpus: int | None = None
    object_store_mb: int | None = None

    _started: bool = PrivateAttr(default=False)

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        self._started = ray_runtime.connect(self.address, self.num_cpus, self.object_store_mb)

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        if self._started:  # only shut down a Ray this resource started
            ray_runtime.disconnect()


class SourcesResource(dg.ConfigurableResource):
    """The configured sources (default `$PRX_SOURCES` or ./sources.yaml)."""

    path: str | None = None

    def load(self) -> SourcesConfig:
        return load_sources(Path(self.path) if self.path else sources_path())


def spec_fields(spec: type, exclude: Iterable[str] = ()) -> type[dg.ConfigurableResource]:
    """A resource base class whose config fields are the fields of the dataclass `spec`
    (same names, types and defaults, less `exclude`), so a setting is declared once, on the
    spec, and reaches the Dagster config (launchpad, YAML) without being copied."""
    hints = typing.get_type_hints(spec)
    namespace: dict = {"__annotations__": {}, "__module__": __name__,
                       "__doc__": f"The fields of {spec.__name__} as resource config."}
    for f in dataclasses.fields(spec):
        if f.name in exclude:
            continue
        namespace["__annotations__"][f.name] = hints[f.name]
        if f.default is not dataclasses.MISSING:
            namespace[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            namespace[f.name] = f.default_factory()
        else:  # a Dagster config field needs a default: every spec field has one
            raise TypeError(f"{spec.__name__}.{f.name} has no default")
    return type(f"{spec.__name__}Fields", (dg.ConfigurableResource,), namespace)


def spec_values(resource: dg.ConfigurableResource, spec: type,
                exclude: Iterable[str] = ()) -> dict:
    """The resource's values of the `spec` fields it took from the spec (see spec_fields)."""
    return {f.name: getattr(resource, f.name) for f in dataclasses.fields(spec)
            if f.name not in set(exclude)}


# The API key is never part of the config: the resource names the variable holding it.
CAPTIONER_SECRETS = ("api_key",)


# ignore[misc]: the base class is made at import time from the spec's fields (spec_fields),
# which mypy cannot follow: it takes the base for Any, so the spec's fields go unchecked here.
class CaptionerResource(spec_fields(CaptionerSpec, exclude=CAPTIONER_SECRETS)):  # type: ignore[misc]
    """Which model captions images, how, and which caption version downstream reads.

    Every field of CaptionerSpec is a field here, with the spec's default. Defaults come
    from `captioner.yaml` (or `$PRX_CAPTIONER`) when present; the `original` backend (the
    source's own captions) needs no model and is the default.
    """

    api_key_env: str = "OPENAI_API_KEY"  # the key is read from this variable, never stored
    chunk_rows: int = 1024  # rows per commit: a killed run loses at most this many
    backfill_cron: str = "0 3 * * *"  # the re-captioning schedule (off until turned on)
    # The version downstream assets read; empty means the version this config produces.
    active_version: str = ""
    # Prices for `cost_per_1000_images` (assumptions by default: see stages/report/cost.py).
    gpu_hour_usd: float = DEFAULT_GPU_HOUR_USD
    cpu_hour_usd: float = DEFAULT_CPU_HOUR_USD

    def spec(self) -> CaptionerSpec:
        return CaptionerSpec(**spec_values(self, CaptionerSpec, exclude=CAPTIONER_SECRETS),
                             api_key=os.environ.get(self.api_key_env, ""))

    def produced_version(self) -> str:
        """The caption version a run with this configuration writes."""
        return self.spec().version()

    def caption_version(self) -> str:
        """The active caption version: what downstream assets read."""
        return self.active_version or self.produced_version()


def captioner_from_file(path: Path | None = None) -> CaptionerResource:
    """The captioner configured in captioner.yaml / $PRX_CAPTIONER (defaults when absent)."""
    path = Path(path or os.environ.get("PRX_CAPTIONER", "captioner.yaml"))
    if not path.exists():
        return CaptionerResource()
    values = yaml.safe_load(path.read_text()) or {}
    if not isinstance(values, dict):
        raise ValueError(f"{path}: expected a mapping of captioner settings")
    try:
        resource = CaptionerResource(**values)
        resource.spec()  # checked now (an endpoint holding a key never reaches the UI)
    except Exception as exc:
        raise ValueError(f"{path}: {exc}") from None
    return resource


# The LLM backends' nested settings: built from the flat LLM fields of the resource.
LABELER_NESTED = ("openai", "vllm")


# ignore[misc]: a base made from LabelerSpec's fields (see CaptionerResource).
class ClassifierResource(spec_fields(LabelerSpec, exclude=LABELER_NESTED)):  # type: ignore[misc]
    """Which backend labels captions visual / text / nsfw: `embedded` (MiniLM + a small
    classifier on the CPU, the default), `openai` (an OpenAI-compatible endpoint) or `vllm`
    (Qwen3-8B through ray.data.llm). Every scalar field of LabelerSpec is a field here."""

    model: str | None = None  # LLM backends; default Qwen/Qwen3-8B
    base_url: str | None = None  # openai: e.g. http://127.0.0.1:8000/v1
    api_key_env: str = "OPENAI_API_KEY"
    concurrency: int = 8  # openai: requests in flight per actor; vllm: engine replicas
    retries: int = 4
    # vllm: each engine's share of its GPU; the caption embedder holds the rest (1.0: the
    # embedder needs a GPU of its own).
    vllm_gpu_share: float = 0.9
    # Prices for `cost_per_1000_images` (assumptions by default: see stages/report/cost.py).
    gpu_hour_usd: float = DEFAULT_GPU_HOUR_USD
    cpu_hour_usd: float = DEFAULT_CPU_HOUR_USD

    def gpus(self) -> float:
        """GPUs a labelling run holds: one per vLLM engine replica, none otherwise."""
        return float(self.concurrency) if self.backend == "vllm" else 0.0

    def spec(self) -> LabelerSpec:
        model = self.model or DEFAULT_LLM
        openai = OpenAISettings(self.base_url, model=model,
                                api_key=os.environ.get(self.api_key_env),
                                concurrency=self.concurrency, retries=self.retries) \
            if self.base_url else None
        return LabelerSpec(**spec_values(self, LabelerSpec, exclude=LABELER_NESTED),
                           openai=openai, vllm=VLLMSettings(
                               model=model, concurrency=self.concurrency,
                               gpu_share=self.vllm_gpu_share))

    def classifier_version(self) -> str:
        return self.spec().version()
