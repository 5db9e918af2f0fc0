"""captions: dense VLM captions per source, incremental, versioned, in the `gpu` pool.

The asset manages its own Lance table (chunked merge-insert commits) instead of returning a
dataset, so a killed run keeps every chunk it committed; it still records `lance_version`,
so downstream inputs load through the Lance IO manager pinned to what was materialised.
"""

from collections import Counter

import dagster as dg
import ray.data

from prx_assets.s3_captions.runs import (
    CaptionRunReport, caption_source, changed_ids, coverage, drop_captions, ensure_table,
    pending_requests)
from prx_assets.s3_captions.captions import TARGET_WORDS, word_histogram
from prx_assets.storage.lance_tables import table_uri
from prx_assets.storage.settings import data_root
from prx_assets.defs.io_managers import COLUMNS_KEY
from prx_assets.defs.lineage import (
    input_versions, materialized_lance_version, recorded_input_version)
from prx_assets.defs.metadata import counts_table
from prx_assets.defs.resources import CaptionerResource, RayResource

GPU_POOL = "gpu"


def build_captions(partitions_def: dg.PartitionsDefinition,
                   captioner: CaptionerResource) -> dg.AssetsDefinition:
    # The caption version is the code version: a new model, prompt or sampling shows every
    # partition as stale in the UI, and the backfill sensor picks them up.
    version = captioner.produced_version()

    @dg.asset(
        partitions_def=partitions_def,
        io_manager_key="lance_io_manager",
        group_name="captions",
        kinds={"ray", "lance"},
        pool=GPU_POOL,
        code_version=version,
        ins={
            "bucketed_images": dg.AssetIn(metadata={COLUMNS_KEY: ["id", "status", "image"]}),
            "raw_images": dg.AssetIn(metadata={COLUMNS_KEY: ["id", "original_caption"]}),
        },
        description="One dense caption per kept image under each caption version (backend, "
                    "model, prompt, sampling, image budget); incremental and resumable.",
    )
    def captions(context: dg.AssetExecutionContext, ray_cluster: RayResource,
                 captioner: CaptionerResource, bucketed_images: ray.data.Dataset,
                 raw_images: ray.data.Dataset) -> dg.MaterializeResult:
        spec = captioner.spec()
        source = context.partition_key
        uri = table_uri(data_root(), "captions", source)
        stale = drop_stale_captions(context, uri, with_caption=not spec.uses_model)
        requests = pending_requests(bucketed_images, raw_images, uri, spec)
        context.log.info(f"captioning {source!r} with {spec.backend} ({spec.model_name}), "
                         f"version {spec.version()}")

        def progress(report: CaptionRunReport) -> None:
            context.log.info(f"committed chunk {report.chunks}: {report.written:,} captions, "
                             f"{report.images_per_s:.1f} images/s")

        report = caption_source(requests, uri, spec, captioner.chunk_rows, on_chunk=progress)
        lance_version = report.lance_version or ensure_table(uri)
        cover = coverage(table_uri(data_root(), "bucketed_images", source), uri, report.version)
        return dg.MaterializeResult(
            metadata={
                **input_versions(context, "bucketed_images", "raw_images"),
                **run_metadata(report, spec, cover),
                "stale_captions_dropped": stale,
                "path": dg.MetadataValue.path(str(uri)),
                "lance_version": lance_version,
            },
            data_version=dg.DataVersion(f"{report.version}@{lance_version}"),
        )

    return captions


def drop_stale_captions(context: dg.AssetExecutionContext, captions_uri, with_caption: bool
                        ) -> int:
    """Captions are done per id, and an id is its key in the source: a file replaced under
    the same name keeps its id. Drop the caption rows of items removed or changed since the
    raw_images version the last captions run read, so they are captioned again."""
    source, raw = context.partition_key, dg.AssetKey("raw_images")
    previous = recorded_input_version(context.instance, context.asset_key, source, "raw_images")
    current = materialized_lance_version(context.instance, raw, source)
    if previous is None or current is None or previous == current or not captions_uri.exists():
        return 0
    raw_uri = table_uri(data_root(), "raw_images", source)
    try:
        ids = changed_ids(raw_uri, previous, current, with_caption)
    except (ValueError, OSError) as exc:  # that version was cleaned up (kept 7 days)
        context.log.warning(f"cannot compare raw_images v{previous} with v{current} "
                            f"({exc}); captions of changed items are not refreshed")
        return 0
    dropped = drop_captions(captions_uri, ids)
    context.log.info(f"{len(ids):,} item(s) removed or changed since raw_images v{previous}: "
                     f"dropped {dropped:,} caption row(s)")
    return dropped


def run_metadata(report: CaptionRunReport, spec, cover) -> dict:
    gpus = gpus_in_use(spec)
    rate = report.images_per_s
    meta = {
        "caption_version": report.version,
        "backend": spec.backend,
        "model": spec.model_name,
        "prompt": spec.prompt_name if spec.uses_model else "none (source captions)",
        "captioned_this_run": report.written,
        "chunks_committed": report.chunks,
        "images_per_s": round(rate, 2),
        "rows_by_status": counts_table(Counter(report.statuses), "status"),
        "caption_words": words_table(report.word_counts),
        "kept_images": cover.kept,
        "coverage": round(cover.share, 4),
        "dagster/row_count": cover.done + cover.failed,
    }
    if gpus and rate > 0:
        meta["images_per_s_per_gpu"] = round(rate / gpus, 2)
        meta["projected_gpu_hours"] = round(cover.kept / (rate / gpus) / 3600, 2)
    elif rate > 0:
        meta["projected_hours_at_this_rate"] = round(cover.kept / rate / 3600, 3)
    return meta


def gpus_in_use(spec) -> float:
    if spec.backend == "vllm":
        tp = int(spec.engine_kwargs.get("tensor_parallel_size", 1))
        pp = int(spec.engine_kwargs.get("pipeline_parallel_size", 1))
        return float(spec.concurrency * tp * pp)
    if spec.backend == "transformers":
        return spec.num_gpus * spec.concurrency
    return 0.0


def words_table(word_counts: list[int]) -> dg.TableMetadataValue:
    lo, hi = TARGET_WORDS
    records = [dg.TableRecord({"words": label, "captions": n}) for label, n in
               word_histogram(word_counts)]
    return dg.MetadataValue.table(records, schema=dg.TableSchema(columns=[
        dg.TableColumn("words", "string", description=f"target {lo}-{hi}"),
        dg.TableColumn("captions", "int")]))


class CaptionCheckConfig(dg.Config):
    min_coverage: float = 0.99
    min_in_target_share: float = 0.8
    max_failure_share: float = 0.01


def caption_checks(partitions_def: dg.PartitionsDefinition) -> list[dg.AssetChecksDefinition]:
    asset = dg.AssetKey("captions")

    def counts(context, captioner: CaptionerResource):
        source = context.partition_key
        return coverage(table_uri(data_root(), "bucketed_images", source),
                        table_uri(data_root(), "captions", source), captioner.caption_version())

    @dg.asset_check(asset=asset, name="coverage", partitions_def=partitions_def,
                    description="Share of kept images captioned under the active version.")
    def caption_coverage(context: dg.AssetCheckExecutionContext, captioner: CaptionerResource,
                         config: CaptionCheckConfig) -> dg.AssetCheckResult:
        c = counts(context, captioner)
        return dg.AssetCheckResult(passed=c.share >= config.min_coverage, metadata={
            "coverage": round(c.share, 4), "kept": c.kept, "done": c.done,
            "active_version": captioner.caption_version()})

    @dg.asset_check(asset=asset, name="length_in_target", partitions_def=partitions_def,
                    description="Share of model captions within 100-200 words (warns).")
    def length_in_target(context: dg.AssetCheckExecutionContext, captioner: CaptionerResource,
                         config: CaptionCheckConfig) -> dg.AssetCheckResult:
        c = counts(context, captioner)
        if not captioner.spec().uses_model:
            return dg.AssetCheckResult(passed=True, metadata={
                "note": "source captions: the length rule applies to model captions only"})
        share = c.in_target / c.ok if c.ok else 0.0
        return dg.AssetCheckResult(
            passed=share >= config.min_in_target_share, severity=dg.AssetCheckSeverity.WARN,
            metadata={"in_target_share": round(share, 4), "ok_captions": c.ok})

    @dg.asset_check(asset=asset, name="failure_share", partitions_def=partitions_def,
                    description="Share of kept images whose captioning failed (retried later).")
    def failure_share(context: dg.AssetCheckExecutionContext, captioner: CaptionerResource,
                      config: CaptionCheckConfig) -> dg.AssetCheckResult:
        c = counts(context, captioner)
        share = c.failed / c.kept if c.kept else 0.0
        return dg.AssetCheckResult(passed=share <= config.max_failure_share, metadata={
            "failure_share": round(share, 4), "failed": c.failed})

    return [caption_coverage, length_in_target, failure_share]
