"""captions: dense VLM captions per source, incremental, versioned, in the `gpu` pool, with
their checks and the re-captioning backfills (a sensor and a schedule).

The asset manages its own Lance table (chunked merge-insert commits) instead of returning a
dataset, so a killed run keeps every chunk it committed; it still records `lance_version`,
so downstream inputs load through the Lance IO manager pinned to what was materialised.

A partition is stale when it has no captions yet, when its captions were made by another
caption version than the configured one, or when bucketed_images changed since (new images).
The schedule also retries partitions whose last run left failed rows. Each request is one
partition per run, in the `gpu` pool (the captions asset names it).
"""

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import dagster as dg
import pyarrow as pa
import pyarrow.compute as pc
import ray.data

from prx_assets.defs.io_managers import COLUMNS_KEY
from prx_assets.defs.leases import asset_lease
from prx_assets.defs.metadata import (
    browser_link,
    counts_table,
    incremental_metadata,
    input_versions,
    latest_materialization,
    materialized_lance_version,
    recorded,
    recorded_input_version,
)
from prx_assets.defs.report import cost_metadata, duration_metadata
from prx_assets.defs.resources import CaptionerResource, RayResource, StorageResource
from prx_assets.engine.chunked import drop_ids
from prx_assets.engine.progress import StageProgress
from prx_assets.stages.captions.captioners import CaptionerSpec
from prx_assets.stages.captions.captions import TARGET_WORDS, word_histogram
from prx_assets.stages.captions.runs import (
    CaptionRunReport,
    awaiting_new_images,
    bucketed_changes,
    caption_source,
    changed_ids,
    count_pending,
    coverage,
    drop_captions,
    ensure_table,
    pending_changed_ids,
    pending_ids,
    pending_requests,
    read_kept,
    record_bucketed_consumed,
    requests_for,
)
from prx_assets.stages.report.charts import human_duration
from prx_assets.storage.layout import Storage
from prx_assets.storage.refs import TableRef
from prx_assets.storage.retention import held_while, hold_version
from prx_assets.storage.tables import BUCKETED_IMAGES, CAPTIONS, RAW_IMAGES

GPU_POOL = "gpu"
RUN_HOLDER = "captions-run"  # the tag holding the versions a captions run reads


def build_captions(partitions_def: dg.PartitionsDefinition,
                   captioner: CaptionerResource) -> dg.AssetsDefinition:
    # The caption version is the code version: a new model, prompt or sampling shows every
    # partition as stale in the UI, and the backfill sensor picks them up.
    version = captioner.produced_version()

    @dg.asset(
        name=CAPTIONS,
        partitions_def=partitions_def,
        io_manager_key="lance_io_manager",
        group_name="captions",
        kinds={"ray", "lance"},
        pool=GPU_POOL,
        code_version=version,
        ins={
            BUCKETED_IMAGES: dg.AssetIn(metadata={COLUMNS_KEY: ["id", "status", "image"]}),
            RAW_IMAGES: dg.AssetIn(metadata={COLUMNS_KEY: ["id", "original_caption"]}),
        },
        description="One dense caption per kept image under each caption version (backend, "
                    "model, prompt, sampling, image budget); incremental and resumable.",
    )
    def captions(context: dg.AssetExecutionContext, ray_cluster: RayResource,
                 captioner: CaptionerResource, storage: StorageResource,
                 bucketed_images: ray.data.Dataset, raw_images: ray.data.Dataset
                 ) -> dg.MaterializeResult:
        spec = captioner.spec()
        source = context.partition_key
        store = storage.get()
        with asset_lease(context, store):
            table = store.table(CAPTIONS, source)
            stale, changed = drop_stale_captions(context, store,
                                                 with_caption=not spec.uses_model)
            # Read here rather than through the IO manager's input: filtered and projected by
            # Lance (no image bytes for the `original` backend; few pending images are read
            # by id), at the versions it pinned.
            bucketed = store.table(BUCKETED_IMAGES, source).at(
                materialized_lance_version(context.instance, BUCKETED_IMAGES, source))
            raw = store.table(RAW_IMAGES, source).at(
                materialized_lance_version(context.instance, RAW_IMAGES, source))
            # Held while the run reads them (hours on GPUs): a blob table frees superseded
            # versions after a 10-minute grace.
            with held_while(bucketed, RUN_HOLDER, bucketed.version), \
                    held_while(raw, RUN_HOLDER, raw.version):
                requests = caption_requests(bucketed, raw, raw_images, table, spec, changed)
                context.log.info(f"captioning {source!r} with {spec.backend} "
                                 f"({spec.model_name}), version {spec.version()}")
                progress = StageProgress(f"{CAPTIONS}[{source}]",
                                         captions_to_make(store, source, spec),
                                         context.log.info, unit="images")
                report = caption_source(requests, table, spec, captioner.chunk_rows,
                                        on_chunk=lambda r: progress.update(r.commits.rows))
                progress.finish()
            ensure_table(table)
            record_bucketed_consumed(bucketed, table, spec)  # a config commit when it moved
            lance_version = ensure_table(table)  # the latest version
            hold_raw_version(context, store)
            cover = coverage(store.table(BUCKETED_IMAGES, source), table, report.version)
            return dg.MaterializeResult(
                metadata={
                    **input_versions(context, BUCKETED_IMAGES, RAW_IMAGES),
                    **run_metadata(report, spec, cover),
                    **cost_metadata(report.seconds, report.commits.rows, gpus_in_use(spec),
                                    captioner.gpu_hour_usd, captioner.cpu_hour_usd),
                    **captions_counts(report, cover, stale),
                    "stale_captions_dropped": stale,
                    "path": dg.MetadataValue.path(table.uri),
                    "lance_version": lance_version, **browser_link(context),
                },
                # Content-driven already: the table's version moves only when a chunk was
                # committed, stale rows were dropped or bucketed changed (the record).
                data_version=dg.DataVersion(f"{report.version}@{lance_version}"),
            )

    return captions


def caption_requests(bucketed: TableRef, raw: TableRef, raw_images: ray.data.Dataset,
                     captions: TableRef, spec: CaptionerSpec, changed: set[str]
                     ) -> ray.data.Dataset | None:
    """The pending requests. With the captions' record of bucketed, from its changes since
    (and, for the `original` backend, the items whose source caption changed: bucketed
    does not change with it); without one, or past a few thousand, from every kept id: a
    model backend selects ids first and reads only their images. A model backend leaves
    out changed items whose new image the image stage has not made yet."""
    changes = bucketed_changes(bucketed, captions, spec)
    changed_ids = pa.array(sorted(changed), pa.string())
    ids = pending_changed_ids(bucketed, changes, captions, spec,
                              None if spec.uses_model else changed_ids) \
        if changes is not None else None
    if not spec.uses_model:
        return requests_for(bucketed, ids, raw) if ids is not None else \
            pending_requests(read_kept(bucketed, spec), raw_images, captions, spec)
    # A replaced file waits for its new image (its bucketed row comes with a later change).
    waiting = awaiting_new_images(bucketed, raw, changed_ids)
    if ids is None:
        ids = pending_ids(bucketed, captions, spec)
    if ids is not None:
        return requests_for(bucketed, ids.filter(pc.invert(pc.is_in(ids, waiting))))
    return drop_ids(pending_requests(read_kept(bucketed, spec), raw_images, captions, spec),
                    waiting)


def drop_stale_captions(context: dg.AssetExecutionContext, store: Storage, with_caption: bool
                        ) -> tuple[int, set[str]]:
    """Captions are done per id, and an id is its key in the source: a file replaced under
    the same name keeps its id. Drop the caption rows of items removed or changed since the
    raw_images version the last captions run read, so they are captioned again; returns
    the rows dropped and those items' ids."""
    source = context.partition_key
    previous = recorded_input_version(context.instance, context.asset_key, source, RAW_IMAGES)
    current = materialized_lance_version(context.instance, RAW_IMAGES, source)
    if previous is None or current is None or previous == current \
            or not store.table(CAPTIONS, source).exists():
        return 0, set()
    try:
        ids = changed_ids(store.table(RAW_IMAGES, source), previous, current, with_caption)
    except (ValueError, OSError) as exc:  # that version was cleaned up (kept 7 days)
        context.log.warning(f"cannot compare raw_images v{previous} with v{current} "
                            f"({exc}); captions of changed items are not refreshed")
        return 0, set()
    dropped = drop_captions(store.table(CAPTIONS, source), ids)
    context.log.info(f"{len(ids):,} item(s) removed or changed since raw_images v{previous}: "
                     f"dropped {dropped:,} caption row(s)")
    return dropped, ids


def hold_raw_version(context: dg.AssetExecutionContext, store: Storage) -> None:
    """Keep the raw_images version this run read until the next run has compared it with
    its own (`drop_stale_captions`): raw_images frees superseded versions after a short
    grace (`PRX_BLOB_GRACE_S`), long before the next captions run may come."""
    source = context.partition_key
    version = materialized_lance_version(context.instance, RAW_IMAGES, source)
    if version is not None:
        hold_version(store.table(RAW_IMAGES, source), CAPTIONS, version)


def captions_to_make(store: Storage, source: str, spec: CaptionerSpec) -> int:
    """The progress total: kept images less the captions of this version already final."""
    return count_pending(store.table(BUCKETED_IMAGES, source), store.table(CAPTIONS, source),
                         spec.version())


def captions_counts(report: CaptionRunReport, cover, stale: int) -> dict:
    """The incremental counts: captions written this run, rows of the active version kept
    from earlier runs, and rows dropped because their item was removed or changed."""
    rows = cover.done + cover.failed  # rows of the active version now in the table
    return incremental_metadata(report.written, max(0, rows - report.written), stale)


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
        **duration_metadata("stage_seconds", report.seconds),
        "rows_by_status": counts_table(Counter(report.statuses), "status"),
        "caption_words": words_table(report.word_counts),
        "kept_images": cover.kept,
        "coverage": round(cover.share, 4),
        "dagster/row_count": cover.done + cover.failed,
    }
    if gpus and rate > 0:
        meta["images_per_s_per_gpu"] = round(rate / gpus, 2)
        meta["projected_gpu_hours"] = round(cover.kept / (rate / gpus) / 3600, 2)
        meta["projected_gpu_time_in_words"] = dg.MetadataValue.text(
            human_duration(cover.kept / (rate / gpus)))
    elif rate > 0:
        meta["projected_hours_at_this_rate"] = round(cover.kept / rate / 3600, 3)
        meta["projected_time_in_words"] = dg.MetadataValue.text(human_duration(cover.kept / rate))
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
    asset = dg.AssetKey(CAPTIONS)

    def counts(context, captioner: CaptionerResource, storage: StorageResource):
        source, store = context.partition_key, storage.get()
        return coverage(store.table(BUCKETED_IMAGES, source), store.table(CAPTIONS, source),
                        captioner.caption_version())

    @dg.asset_check(asset=asset, name="coverage", partitions_def=partitions_def,
                    description="Share of kept images captioned under the active version.")
    def caption_coverage(context: dg.AssetCheckExecutionContext, captioner: CaptionerResource,
                         storage: StorageResource,
                         config: CaptionCheckConfig) -> dg.AssetCheckResult:
        c = counts(context, captioner, storage)
        return dg.AssetCheckResult(passed=c.share >= config.min_coverage, metadata={
            "coverage": round(c.share, 4), "kept": c.kept, "done": c.done,
            "active_version": captioner.caption_version()})

    @dg.asset_check(asset=asset, name="length_in_target", partitions_def=partitions_def,
                    description="Share of model captions within 100-200 words (warns).")
    def length_in_target(context: dg.AssetCheckExecutionContext, captioner: CaptionerResource,
                         storage: StorageResource,
                         config: CaptionCheckConfig) -> dg.AssetCheckResult:
        c = counts(context, captioner, storage)
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
                      storage: StorageResource,
                      config: CaptionCheckConfig) -> dg.AssetCheckResult:
        c = counts(context, captioner, storage)
        share = c.failed / c.kept if c.kept else 0.0
        return dg.AssetCheckResult(passed=share <= config.max_failure_share, metadata={
            "failure_share": round(share, 4), "failed": c.failed})

    return [caption_coverage, length_in_target, failure_share]


@dataclass(frozen=True)
class StalePartition:
    partition: str
    reason: str  # "missing", "new caption version", "new images", "failed rows"
    run_key: str


def stale_partitions(instance: dg.DagsterInstance, partitions: Sequence[str], version: str,
                     retry_failures: bool = False) -> list[StalePartition]:
    """Partitions whose captions need a run, with why; sources without images are skipped."""
    stale = []
    for partition in partitions:
        bucketed = latest_materialization(instance, BUCKETED_IMAGES, partition)
        if bucketed is None:
            continue  # nothing to caption until the image stage has run
        images_version = recorded(bucketed, "lance_version")
        captions = latest_materialization(instance, CAPTIONS, partition)
        reason = _why_stale(captions, version, images_version, retry_failures)
        if reason:
            captions_version = recorded(captions, "lance_version")
            key = f"captions:{partition}:{version}:{images_version}:{captions_version}"
            stale.append(StalePartition(partition, reason, key))
    return stale


def _why_stale(captions, version: str, images_version, retry_failures: bool) -> str | None:
    if captions is None:
        return "missing"
    if recorded(captions, "caption_version") != version:
        return "new caption version"
    if recorded(captions, f"input_version/{BUCKETED_IMAGES}") != images_version:
        return "new images"
    if retry_failures and (_failed_rows(captions) or 0) > 0:
        return "failed rows"
    return None


def _failed_rows(materialization) -> int | None:
    table = recorded(materialization, "rows_by_status")
    if table is None:
        return None
    return sum(int(r.data["count"]) for r in table.records if r.data["status"] == "failed")


def _requests(stale: list[StalePartition], job_name: str) -> list[dg.RunRequest]:
    return [dg.RunRequest(run_key=s.run_key, partition_key=s.partition, job_name=job_name,
                          tags={"prx/recaption_reason": s.reason})
            for s in stale]


def build_recaption_automation(job,
                               partitions_def: dg.PartitionsDefinition,
                               cron: str) -> tuple[dg.SensorDefinition, dg.ScheduleDefinition]:
    @dg.sensor(job=job, minimum_interval_seconds=300, default_status=dg.DefaultSensorStatus.STOPPED,
               description="Requests a captions run for every source partition whose captions "
                           "are missing or stale (new images, or a new caption version).")
    def recaption_sensor(context: dg.SensorEvaluationContext, captioner: CaptionerResource):
        stale = stale_partitions(context.instance, partitions_def.get_partition_keys(),
                                 captioner.produced_version())
        if not stale:
            return dg.SkipReason("every source's captions are current")
        return _requests(stale, job.name)

    @dg.schedule(job=job, cron_schedule=cron,
                 default_status=dg.DefaultScheduleStatus.STOPPED,
                 description="Periodic re-captioning backfill: stale partitions, and partitions "
                             "whose last run left failed rows to retry.")
    def recaption_schedule(context: dg.ScheduleEvaluationContext, captioner: CaptionerResource):
        stale = stale_partitions(context.instance, partitions_def.get_partition_keys(),
                                 captioner.produced_version(), retry_failures=True)
        if not stale:
            return dg.SkipReason("every source's captions are current")
        # Schedule run keys only dedupe within a tick, so a partition whose failed rows
        # still fail is retried again on the next tick (and no more often).
        return [dg.RunRequest(run_key=s.run_key, partition_key=s.partition,
                              tags={"prx/recaption_reason": s.reason}) for s in stale]

    return recaption_sensor, recaption_schedule


def caption_defs(partitions_def: dg.PartitionsDefinition, captioner: CaptionerResource
                 ) -> dg.Definitions:
    """The captions asset, its checks, the captions job and its backfill automation."""
    captions = build_captions(partitions_def, captioner)
    captions_job = dg.define_asset_job(
        "captions_job", selection=dg.AssetSelection.assets(captions), partitions_def=partitions_def,
        description="(Re-)caption one source: what the backfill sensor and schedule launch.")
    sensor, schedule = build_recaption_automation(captions_job, partitions_def,
                                                  captioner.backfill_cron)
    return dg.Definitions(assets=[captions], asset_checks=caption_checks(partitions_def),
                          jobs=[captions_job], sensors=[sensor], schedules=[schedule])
