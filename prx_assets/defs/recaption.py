"""Re-captioning backfills: a sensor and a schedule that find stale caption partitions.

A partition is stale when it has no captions yet, when its captions were made by another
caption version than the configured one, or when bucketed_images changed since (new images).
The schedule also retries partitions whose last run left failed rows. Each request is one
partition per run, in the `gpu` pool (the captions asset names it).
"""

from dataclasses import dataclass
from typing import Optional

import dagster as dg

from prx_assets.defs.resources import CaptionerResource

CAPTIONS = dg.AssetKey("captions")
BUCKETED = dg.AssetKey("bucketed_images")


@dataclass(frozen=True)
class StalePartition:
    partition: str
    reason: str  # "missing", "new caption version", "new images", "failed rows"
    run_key: str


def _latest(instance: dg.DagsterInstance, key: dg.AssetKey, partition: str):
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=key, asset_partitions=[partition]), limit=1).records
    return records[0] if records else None


def _meta(record, name: str):
    value = record.asset_materialization.metadata.get(name)
    return value.value if value is not None else None


def stale_partitions(instance: dg.DagsterInstance, partitions: list[str], version: str,
                     retry_failures: bool = False) -> list[StalePartition]:
    """Partitions whose captions need a run, with why; sources without images are skipped."""
    stale = []
    for partition in partitions:
        bucketed = _latest(instance, BUCKETED, partition)
        if bucketed is None:
            continue  # nothing to caption until the image stage has run
        images_version = _meta(bucketed, "lance_version")
        captions = _latest(instance, CAPTIONS, partition)
        reason = _why_stale(captions, version, images_version, retry_failures)
        if reason:
            captions_version = _meta(captions, "lance_version") if captions else None
            key = f"captions:{partition}:{version}:{images_version}:{captions_version}"
            stale.append(StalePartition(partition, reason, key))
    return stale


def _why_stale(captions, version: str, images_version, retry_failures: bool) -> Optional[str]:
    if captions is None:
        return "missing"
    if _meta(captions, "caption_version") != version:
        return "new caption version"
    if _meta(captions, "input_version/bucketed_images") != images_version:
        return "new images"
    if retry_failures and (_failed_rows(captions) or 0) > 0:
        return "failed rows"
    return None


def _failed_rows(record) -> Optional[int]:
    table = record.asset_materialization.metadata.get("rows_by_status")
    if table is None:
        return None
    return sum(int(r.data["count"]) for r in table.value.records if r.data["status"] == "failed")


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
