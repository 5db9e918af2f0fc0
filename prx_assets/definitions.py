"""The Dagster code location: `prx_assets.definitions:defs`.

`build_defs(sources_file)` builds the same graph for any sources file (tests use it): each
stage's definitions, in pipeline order, merged with the shared resources and the jobs that
run them per source or across sources, and the factory's sensors and automation conditions
(`defs/factory.py`, off unless `PRX_FACTORY=on`).
"""

from __future__ import annotations

import os
from pathlib import Path

import dagster as dg

from prx_assets.defs.attributes import AttributerResource, attribute_defs
from prx_assets.defs.captions import caption_defs
from prx_assets.defs.corpus import corpus_defs
from prx_assets.defs.dedup import dedup_defs
from prx_assets.defs.executor import in_process_concurrent_executor
from prx_assets.defs.factory import FRESH_ASSETS, automate, factory_defs, fresh
from prx_assets.defs.images import image_defs
from prx_assets.defs.ingest import ingest_defs
from prx_assets.defs.io_managers import RayLanceIOManager
from prx_assets.defs.labels import label_defs
from prx_assets.defs.opt_outs import opt_out_defs
from prx_assets.defs.partitions import source_partitions
from prx_assets.defs.report import report_defs
from prx_assets.defs.resources import (
    ClassifierResource,
    RayResource,
    SourcesResource,
    StorageResource,
    captioner_from_file,
)
from prx_assets.defs.semantic import ImageEncoderResource, semantic_defs
from prx_assets.defs.shards import shard_defs
from prx_assets.defs.skip_lists import skip_list_defs
from prx_assets.defs.subsets import subset_defs
from prx_assets.registry import JOBS, PER_SOURCE, SUBSET, automated
from prx_assets.stages.ingest.sources import load_sources, sources_path
from prx_assets.stages.subsets.definitions import subsets_path


def pipeline_jobs(partitions: dg.PartitionsDefinition) -> list[dg.UnresolvedAssetJobDefinition]:
    """The jobs `make demo` and the UI run, from the registry: per source, then across
    sources (the subset job is built with the subsets, `defs/subsets`)."""
    return [dg.define_asset_job(job.name, selection=dg.AssetSelection.assets(*job.assets),
                                partitions_def=partitions if job.partitioning == PER_SOURCE
                                else None, description=job.description)
            for job in JOBS if job.partitioning != SUBSET]


def build_defs(sources_file: Path | None = None, captioner_file: Path | None = None,
               subsets_file: Path | None = None) -> dg.Definitions:
    """`subsets_file` defaults to `$PRX_SUBSETS`, or `subsets.yaml` beside the sources file."""
    sources_file = Path(sources_file) if sources_file else sources_path()
    subsets_file = Path(subsets_file) if subsets_file else default_subsets_file(sources_file)
    captioner = captioner_from_file(captioner_file)
    sources = load_sources(sources_file)
    partitions = source_partitions(sources)
    storage = StorageResource()
    stages = [
        ingest_defs(partitions),
        image_defs(partitions),
        caption_defs(partitions, captioner),
        label_defs(partitions),
        attribute_defs(partitions),
        dedup_defs(),
        opt_out_defs(str(sources_file)),
        shard_defs(partitions),
        skip_list_defs(partitions),
        corpus_defs(partitions),
        semantic_defs(partitions),
        report_defs(),
        subset_defs(subsets_file),
        factory_defs(sources),
    ]
    shared = dg.Definitions(
        jobs=pipeline_jobs(partitions),
        # Every step of a run in the run's own process: the stages parallelise through Ray,
        # and a process per step re-imported the package and started Ray again for each
        # asset and check (a 3-file raw_images run from the UI: 2 min 50 s, each of its three
        # checks 30-40 s of start-up for well under 1 s of work). Pools still apply per op.
        # Steps that do not depend on each other run at the same time, in threads of the
        # run's process (defs/executor.py; `max_concurrent: 1` runs them one at a time).
        executor=in_process_concurrent_executor,
        resources={
            "storage": storage,
            "ray_cluster": RayResource(),
            "sources": SourcesResource(path=str(sources_file)),
            "lance_io_manager": RayLanceIOManager(storage=storage),
            "captioner": captioner,
            "classifier": ClassifierResource(),
            "attributer": AttributerResource(),
            "image_encoder": ImageEncoderResource(),
        })
    return dg.Definitions.merge(*stages, shared).map_resolved_asset_specs(
        func=automate, selection=dg.AssetSelection.assets(*automated())
    ).map_resolved_asset_specs(func=fresh, selection=dg.AssetSelection.assets(*FRESH_ASSETS))


def default_subsets_file(sources_file: Path) -> Path:
    if os.environ.get("PRX_SUBSETS"):
        return subsets_path()
    return sources_file.resolve().parent / "subsets.yaml"


@dg.definitions
def defs() -> dg.Definitions:
    return build_defs()
