"""Dagster resources: the Ray connection and the sources file."""


from pathlib import Path
from typing import Optional

import dagster as dg
from pydantic import PrivateAttr

from prx_assets.core import ray_runtime
from prx_assets.core.sources import SourcesConfig, load_sources, sources_path


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

        from prx_assets.core.label_backends import DEFAULT_LLM, OpenAISettings, VLLMSettings
        from prx_assets.core.label_runs import LabelerSpec

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
