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
