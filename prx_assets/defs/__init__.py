"""Dagster wiring: assets, checks and resources built for a given sources file."""

from __future__ import annotations

from pathlib import Path

import dagster as dg

from prx_assets.s1_ingest.sources import load_sources, sources_path
from prx_assets.defs.assets.raw_images import build_raw_images
from prx_assets.defs.assets.images import build_image_stage
from prx_assets.defs.assets.captions import build_captions, caption_checks
from prx_assets.defs.assets.mds_shards import build_mds_shards, mds_tree_check
from prx_assets.defs.assets.labels import (
    build_caption_labels, build_corpus_asset, caption_labels_checks)
from prx_assets.defs.assets.dedup import build_duplicates
from prx_assets.defs.assets.opt_outs import build_opt_outs
from prx_assets.defs.assets.skip_lists import (
    build_skip_lists_asset, skipped_share_check)
from prx_assets.defs.sensors import build_opt_out_sensor
from prx_assets.defs.rewrite import build_rewrite_job
from prx_assets.defs.checks import jpeg_fidelity_check, table_checks
from prx_assets.defs.io_managers import RayLanceIOManager
from prx_assets.defs.partitions import source_partitions
from prx_assets.defs.recaption import build_recaption_automation
from prx_assets.defs.resources import (
    ClassifierResource, RayResource, SourcesResource, captioner_from_file)


# Assets over every source at once: run on their own, not once per source partition.
GLOBAL_ASSETS = dg.AssetSelection.assets("duplicates", "opt_outs")
# Skip lists need the global duplicates, so they run after dedup_job, per source.
SKIP_LISTS = dg.AssetSelection.assets("skip_lists")


def build_defs(sources_file: Path | None = None, captioner_file: Path | None = None
               ) -> dg.Definitions:
    sources_file = Path(sources_file) if sources_file else sources_path()
    captioner = captioner_from_file(captioner_file)
    partitions = source_partitions(load_sources(sources_file))
    raw_images = build_raw_images(partitions)
    image_stage = build_image_stage(partitions)
    captions = build_captions(partitions, captioner)
    caption_labels = build_caption_labels(partitions)
    corpus = build_corpus_asset(partitions)
    corpus_selection = dg.AssetSelection.assets(corpus)  # global: its own job
    captions_job = dg.define_asset_job(
        "captions_job", selection=dg.AssetSelection.assets(captions), partitions_def=partitions,
        description="(Re-)caption one source: what the backfill sensor and schedule launch.")
    recaption_sensor, recaption_schedule = build_recaption_automation(
        captions_job, partitions, captioner.backfill_cron)
    checks = [
        *table_checks(dg.AssetKey("raw_images"), partitions),
        *table_checks(dg.AssetKey("bucketed_images"), partitions, with_reject_share=False),
        *table_checks(dg.AssetKey("phashes"), partitions, with_reject_share=False),
        jpeg_fidelity_check(partitions),
        *caption_checks(partitions),
        mds_tree_check(partitions),
        *caption_labels_checks(partitions),
        skipped_share_check(partitions),
    ]
    resources = {
        "ray_cluster": RayResource(),
        "sources": SourcesResource(path=str(sources_file)),
        "lance_io_manager": RayLanceIOManager(),
        "captioner": captioner,
        "classifier": ClassifierResource(),
    }
    return dg.Definitions(
        assets=[raw_images, image_stage, captions, caption_labels, build_mds_shards(partitions),
                corpus, build_duplicates(), build_opt_outs(),
                build_skip_lists_asset(partitions)],
        asset_checks=checks,
        resources=resources,
        sensors=[recaption_sensor, build_opt_out_sensor(str(sources_file))],
        schedules=[recaption_schedule],
        jobs=[dg.define_asset_job("corpus_job",
                                  selection=(dg.AssetSelection.all() - GLOBAL_ASSETS - SKIP_LISTS
                                             - corpus_selection),
                                  partitions_def=partitions,
                                  description="Every asset of the corpus for one source."),
              captions_job,
              dg.define_asset_job("corpus_table_job", selection=corpus_selection,
                                  description="The searchable corpus table across sources."),
              dg.define_asset_job("dedup_job", selection=GLOBAL_ASSETS,
                                  description="Global duplicates and the opt-out audit."),
              dg.define_asset_job("skip_lists_job", selection=SKIP_LISTS,
                                  partitions_def=partitions,
                                  description="One source's skip lists (after dedup_job)."),
              build_rewrite_job(partitions)],
    )
