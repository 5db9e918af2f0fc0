"""One partition per configured source, static from the sources file."""

from __future__ import annotations

import dagster as dg

from prx_assets.stages.ingest.sources import SourcesConfig


def source_partitions(sources: SourcesConfig) -> dg.StaticPartitionsDefinition:
    return dg.StaticPartitionsDefinition(sources.names)
