"""Dagster resources: storage, the Ray connection, the sources file and the models."""


import dataclasses
import os
from pathlib import Path
from typing import Optional

import yaml

import dagster as dg
from pydantic import PrivateAttr

from prx_assets.engine import ray_runtime
from prx_assets.s3_captions.captioners import CaptionerSpec
from prx_assets.s3_captions.captions import DEFAULT_PROMPT
from prx_assets.s1_ingest.sources import SourcesConfig, load_sources, sources_path
from prx_assets.storage.layout import Storage


class StorageResource(dg.ConfigurableResource):
    """Where the corpus lives: `root`, or `$PRX_DATA_ROOT` (default ./data) when unset.

    Read at run time, not at definition time, so one code location serves any root."""

    root: Optional[str] = None

    def get(self) -> Storage:
        return Storage(self.root) if self.root else Storage.from_env()


class RayResource(dg.ConfigurableResource):
    """Embedded local Ray unless `address` (or the RAY_ADDRESS env var) names a cluster."""

    address: Optional[str] = None
    num_cpus: Optional[int] = None
    object_store_mb: Optional[int] = None

    _started: bool = PrivateAttr(default=False)

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        self._started = ray_runtime.connect(self.address, self.num_cpus, self.object_store_mb)

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        if self._started:  # only shut down a Ray this resource started
            ray_runtime.disconnect()


class SourcesResource(dg.ConfigurableResource):
    """The configured sources (default `$PRX_SOURCES` or ./sources.yaml)."""

    path: Optional[str] = None

    def load(self) -> SourcesConfig:
        return load_sources(Path(self.path) if self.path else sources_path())


class CaptionerResource(dg.ConfigurableResource):
    """Which model captions images, how, and which caption version downstream reads.

    Defaults come from `captioner.yaml` (or `$PRX_CAPTIONER`) when present; the `original`
    backend (the source's own captions) needs no model and is the default.
    """

    backend: str = "original"
    model: str = ""
    prompt_name: str = DEFAULT_PROMPT
    max_tokens: int = 320
    temperature: float = 0.2
    top_p: float = 0.9
    repetition_penalty: float = 1.05
    image_budget: int = 448 * 448
    seed: int = 0
    batch_size: int = 16
    concurrency: int = 1
    num_gpus: float = 0.0
    cpus_per_actor: float = 1.0
    engine_kwargs: dict = {}
    accelerator_type: Optional[str] = None
    continue_on_error: bool = True
    endpoint: str = ""
    api_key_env: str = "OPENAI_API_KEY"  # the key is read from this variable, never stored
    request_concurrency: int = 8
    timeout_s: float = 120.0
    max_retries: int = 4
    backoff_s: float = 1.0
    chunk_rows: int = 1024  # rows per commit: a killed run loses at most this many
    backfill_cron: str = "0 3 * * *"  # the re-captioning schedule (off until turned on)
    # The version downstream assets read; empty means the version this config produces.
    active_version: str = ""

    def spec(self) -> CaptionerSpec:
        fields = {f.name for f in dataclasses.fields(CaptionerSpec)} - {"api_key"}
        values = {name: getattr(self, name) for name in fields}
        return CaptionerSpec(**values, api_key=os.environ.get(self.api_key_env, ""))

    def produced_version(self) -> str:
        """The caption version a run with this configuration writes."""
        return self.spec().version()

    def caption_version(self) -> str:
        """The active caption version: what downstream assets read."""
        return self.active_version or self.produced_version()


def captioner_from_file(path: Optional[Path] = None) -> CaptionerResource:
    """The captioner configured in captioner.yaml / $PRX_CAPTIONER (defaults when absent)."""
    path = Path(path or os.environ.get("PRX_CAPTIONER", "captioner.yaml"))
    if not path.exists():
        return CaptionerResource()
    values = yaml.safe_load(path.read_text()) or {}
    if not isinstance(values, dict):
        raise ValueError(f"{path}: expected a mapping of captioner settings")
    try:
        return CaptionerResource(**values)
    except Exception as exc:
        raise ValueError(f"{path}: {exc}") from None

class ClassifierResource(dg.ConfigurableResource):
    """Which backend labels captions visual / text / nsfw: `embedded` (MiniLM + a small
    classifier on the CPU, the default), `openai` (an OpenAI-compatible endpoint) or `vllm`
    (Qwen3-8B through ray.data.llm)."""

    backend: str = "embedded"
    actors: int = 1
    threads_per_actor: int = 1
    batch_size: int = 64
    model: Optional[str] = None  # LLM backends; default Qwen/Qwen3-8B
    base_url: Optional[str] = None  # openai: e.g. http://127.0.0.1:8000/v1
    api_key_env: str = "OPENAI_API_KEY"
    concurrency: int = 8  # openai: requests in flight per actor; vllm: engine replicas
    retries: int = 4

    def spec(self):
        import os

        from prx_assets.s4_labels.backends import DEFAULT_LLM, OpenAISettings, VLLMSettings
        from prx_assets.s4_labels.runs import LabelerSpec

        model = self.model or DEFAULT_LLM
        openai = OpenAISettings(self.base_url, model=model,
                                api_key=os.environ.get(self.api_key_env),
                                concurrency=self.concurrency, retries=self.retries) \
            if self.base_url else None
        return LabelerSpec(self.backend, actors=self.actors,
                           threads_per_actor=self.threads_per_actor, batch_size=self.batch_size,
                           openai=openai, vllm=VLLMSettings(model=model,
                                                            concurrency=self.concurrency))

    def classifier_version(self) -> str:
        return self.spec().version()
