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
import ray.data

from prx_assets.defs.asset_leases import asset_lease
from prx_assets.defs.io_managers import COLUMNS_KEY
from prx_assets.defs.metadata import (
    INPUT_VERSION,
    counts_table,
    latest_materialization,
    pin_inputs,
    recorded,
    recorded_input_version,
    stage_result,
)
from prx_assets.defs.report import cost_metadata, duration_metadata
from prx_assets.defs.resources import CaptionerResource, RayResource, StorageResource
from prx_assets.engine.progress import StageProgress
from prx_assets.engine.stage import Coverage, run_stage
from prx_assets.stages.captions.captioners import CaptionerSpec
from prx_assets.stages.captions.captions import (
    STATUS_FAILED,
    STATUS_OK,
    TARGET_WORDS,
    word_histogram,
)
from prx_assets.stages.captions.runs import (
    CaptionRunReport,
    CaptionStage,
    captions_coverage,
    changed_ids,
    done_rows,
    drop_captions,
    in_target_rows,
)
from prx_assets.stages.report.charts import human_duration
from prx_assets.storage.layout import Storage
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
            # Read here rather than through the IO manager's inputs: filtered and projected
            # by Lance (no image bytes for the `original` backend; few pending images are
            # read by id), at the versions pinned as every stage pins them.
            inputs = pin_inputs(store, source, BUCKETED_IMAGES, RAW_IMAGES)
            bucketed, raw = inputs[BUCKETED_IMAGES], inputs[RAW_IMAGES]
            stale, changed = drop_stale_captions(context, store, raw.version,
                                                 with_caption=not spec.uses_model)
            # Held while the run reads them (hours on GPUs): a blob table frees superseded
            # versions after a 10-minute grace.
            with held_while(bucketed, RUN_HOLDER, bucketed.version), \
                    held_while(raw, RUN_HOLDER, raw.version):
                context.log.info(f"captioning {source!r} with {spec.backend} "
                                 f"({spec.model_name}), version {spec.version()}")
                progress = StageProgress(f"{CAPTIONS}[{source}]", None, context.log.info,
                                         unit="images")
                report = run_stage(CaptionStage(spec, raw, changed), bucketed,
                                   table, captioner.chunk_rows,
                                   on_chunk=lambda r: progress.update(r.commits.rows,
                                                                      total=r.to_do))
                progress.total = report.to_do
                progress.finish()
            lance_version = table.latest_version()  # after the record (a config commit)
            if raw.version is not None:
                # Kept until the next run has compared it with its own (`drop_stale_captions`):
                # raw_images frees superseded versions after a short grace
                # (`PRX_BLOB_GRACE_S`), long before the next captions run may come.
                hold_version(raw, CAPTIONS, raw.version)
            cover = captions_coverage(bucketed, table, report.version)
            return stage_result(
                context, inputs=inputs.versions(), lance_version=lance_version,
                processed=report.written, reused=max(0, cover.rows() - report.written),
                removed=stale, seconds=report.seconds,
                # Content-driven already: the table's version moves only when a chunk was
                # committed, stale rows were dropped or bucketed changed (the record).
                data_version=dg.DataVersion(f"{report.version}@{lance_version}"),
                metadata={
                    **run_metadata(report, spec, cover),
                    **cost_metadata(report.seconds, report.commits.rows, gpus_in_use(spec),
                                    captioner.gpu_hour_usd, captioner.cpu_hour_usd),
                    "stale_captions_dropped": stale,
                    "path": dg.MetadataValue.path(table.uri),
                })

    return captions


def drop_stale_captions(context: dg.AssetExecutionContext, store: Storage, current: int | None,
                        with_caption: bool) -> tuple[int, set[str]]:
    """Captions are done per id, and an id is its key in the source: a file replaced under
    the same name keeps its id. Drop the caption rows of items removed or changed since the
    raw_images version the last captions run read (to `current`, this run's), so they are
    captioned again; returns the rows dropped and those items' ids."""
    source = context.partition_key
    previous = recorded_input_version(context.instance, context.asset_key, source, RAW_IMAGES)
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


def run_metadata(report: CaptionRunReport, spec: CaptionerSpec, cover: Coverage) -> dict:
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
        "rows_by_status": counts_table(Counter(report.counts), "status"),
        "caption_words": words_table(report.word_counts),
        "kept_images": cover.inputs,
        "coverage": round(cover.share(done_rows(cover)), 4),
        "dagster/row_count": cover.rows(),
    }
    if gpus and rate > 0:
        meta["images_per_s_per_gpu"] = round(rate / gpus, 2)
        meta["projected_gpu_hours"] = round(cover.inputs / (rate / gpus) / 3600, 2)
        meta["projected_gpu_time_in_words"] = dg.MetadataValue.text(
            human_duration(cover.inputs / (rate / gpus)))
    elif rate > 0:
        meta["projected_hours_at_this_rate"] = round(cover.inputs / rate / 3600, 3)
        meta["projected_time_in_words"] = dg.MetadataValue.text(human_duration(cover.inputs / rate))
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
        return captions_coverage(store.table(BUCKETED_IMAGES, source),
                                 store.table(CAPTIONS, source), captioner.caption_version())

    @dg.asset_check(asset=asset, name="coverage", partitions_def=partitions_def,
                    description="Share of kept images captioned under the active version.")
    def caption_coverage(context: dg.AssetCheckExecutionContext, captioner: CaptionerResource,
                         storage: StorageResource,
                         config: CaptionCheckConfig) -> dg.AssetCheckResult:
        c = counts(context, captioner, storage)
        share = c.share(done_rows(c))
        return dg.AssetCheckResult(passed=share >= config.min_coverage, metadata={
            "coverage": round(share, 4), "kept": c.inputs, "done": done_rows(c),
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
        ok = c.rows(STATUS_OK)
        in_target = in_target_rows(storage.get().table(CAPTIONS, context.partition_key),
                                   captioner.caption_version())
        share = in_target / ok if ok else 0.0
        return dg.AssetCheckResult(
            passed=share >= config.min_in_target_share, severity=dg.AssetCheckSeverity.WARN,
            metadata={"in_target_share": round(share, 4), "ok_captions": ok})

    @dg.asset_check(asset=asset, name="failure_share", partitions_def=partitions_def,
                    description="Share of kept images whose captioning failed (retried later).")
    def failure_share(context: dg.AssetCheckExecutionContext, captioner: CaptionerResource,
                      storage: StorageResource,
                      config: CaptionCheckConfig) -> dg.AssetCheckResult:
        c = counts(context, captioner, storage)
        share = c.share(c.rows(STATUS_FAILED)) if c.inputs else 0.0
        return dg.AssetCheckResult(passed=share <= config.max_failure_share, metadata={
            "failure_share": round(share, 4), "failed": c.rows(STATUS_FAILED)})

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
    if recorded(captions, f"{INPUT_VERSION}{BUCKETED_IMAGES}") != images_version:
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
