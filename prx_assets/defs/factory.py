"""The factory running itself: a sensor per source that notices new, changed and removed
files and requests that source's incremental `raw_images` run, and declarative automation
(`AutomationCondition.eager()`) that carries each update downstream, per source partition,
up to `mds_shards` and `skip_lists`.

Off by default: the sensors start STOPPED and the automation sensor too, so the demo's
instance runs only what someone launches. `PRX_FACTORY=on` (read when the code location
loads) starts them all; each can also be switched on alone in the UI (docs/factory.md).
Automatic runs go through the instance's run queue like any other, so the concurrency
limits of dagster.yaml and the `gpu` pool hold for them.

A global step's change does not start every source's `skip_lists`: its table records, per
source, the version at which that source's group rows last changed, and the group change
sensor requests the skip lists of only the sources whose change their last run has not read
(a new tar that joins no other source's group starts its own skip lists only).

Also here: the freshness policies of `mds_shards` and `skip_lists` (a source whose tree
stopped updating shows in the UI's asset health) and the run-failure sensor, which logs
one line per failed run naming the failing step and its cause.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta

import dagster as dg

from prx_assets.defs.metadata import recorded_input_version
from prx_assets.defs.resources import StorageResource
from prx_assets.registry import automated
from prx_assets.stages.ingest.listing import ListingError, SourceNotFoundError
from prx_assets.stages.ingest.sources import SourcesConfig, SourceSpec
from prx_assets.stages.ingest.watch import ListingDigest, change_reason, listing_digest
from prx_assets.storage.changes import groups_changed_at
from prx_assets.storage.object_store import ObjectStoreError
from prx_assets.storage.tables import (
    CONCEPTS,
    DUPLICATES,
    MDS_SHARDS,
    OPT_OUTS,
    RAW_IMAGES,
    SEMANTIC_DUPLICATES,
    SKIP_LISTS,
)

FACTORY_SETTING = "PRX_FACTORY"
# The assets automation materialises once raw_images changed, in the order they follow it
# (the registry's `automated` steps).
AUTOMATED = automated()
# Seconds between two listings of a source: a listing of a big bucket is the tick's cost
# (`PRX_SOURCE_SENSOR_INTERVAL_S`, read when the code location loads).
SOURCE_SENSOR_INTERVAL = 300
INTERVAL_SETTING = "PRX_SOURCE_SENSOR_INTERVAL_S"
# A source's tree and skip lists not updated for this long: the asset's health warns, then
# fails (the factory updates them within minutes of a source change).
FRESH_WARN, FRESH_FAIL = timedelta(days=1), timedelta(days=3)
FRESHNESS = dg.FreshnessPolicy.time_window(fail_window=FRESH_FAIL, warn_window=FRESH_WARN)
FRESH_ASSETS = (MDS_SHARDS, SKIP_LISTS)
FAILURE_SENSOR = "run_failure_reporter"
# Tags on every run a source sensor requests: the UI shows them on the run.
TRIGGER_TAG = "prx/trigger"
REASON_TAG = "prx/trigger_reason"


def factory_on() -> bool:
    """Whether the factory runs itself (`PRX_FACTORY=on`; off when unset)."""
    return os.environ.get(FACTORY_SETTING, "off").strip().lower() in {"on", "1", "true", "yes"}


def _status() -> dg.DefaultSensorStatus:
    return dg.DefaultSensorStatus.RUNNING if factory_on() else dg.DefaultSensorStatus.STOPPED


def source_sensor_interval() -> int:
    """Seconds between a source sensor's listings: `PRX_SOURCE_SENSOR_INTERVAL_S`, default
    SOURCE_SENSOR_INTERVAL."""
    text = os.environ.get(INTERVAL_SETTING, "").strip()
    if not text:
        return SOURCE_SENSOR_INTERVAL
    if not text.isdigit() or not 1 <= int(text) <= 86_400:
        raise ValueError(f"{INTERVAL_SETTING}={text!r}: a whole number of seconds, 1 to 86400")
    return int(text)


def sensor_name(source: str) -> str:
    return f"{source}_source_sensor"


def build_source_sensor(spec: SourceSpec, location: str) -> dg.SensorDefinition:
    """Lists the source every `source_sensor_interval()` seconds; when the digest of the
    listing differs from the cursor's, requests the source's `raw_images` run (its run key
    is the new digest, so one listing state launches one run)."""

    @dg.sensor(
        name=sensor_name(spec.name), target=dg.AssetSelection.assets(RAW_IMAGES),
        minimum_interval_seconds=source_sensor_interval(), default_status=_status(),
        description=f"Lists source {spec.name!r} ({location}) and requests its incremental "
                    "raw_images run when a file was added, removed or rewritten. The cursor "
                    "is a digest of the listing.")
    def source_sensor(context: dg.SensorEvaluationContext) -> dg.SensorResult | dg.SkipReason:
        before = ListingDigest.from_cursor(context.cursor)
        try:
            now = listing_digest(spec, location)
        except (ListingError, SourceNotFoundError, ObjectStoreError) as exc:
            # The cursor stays: the next complete listing is compared with the last one.
            return dg.SkipReason(f"source {spec.name!r} not listed, nothing requested: {exc}")
        reason = change_reason(before, now)
        if reason is None:
            return dg.SkipReason(f"source {spec.name!r} unchanged ({now.units:,} unit(s))")
        context.log.info(f"source {spec.name!r}: {reason}")
        request = dg.RunRequest(
            run_key=f"{spec.name}:{now.digest}", partition_key=spec.name,
            asset_selection=[dg.AssetKey(RAW_IMAGES)],
            tags={TRIGGER_TAG: sensor_name(spec.name), REASON_TAG: reason})
        return dg.SensorResult(run_requests=[request], cursor=now.to_cursor())

    return source_sensor


# Upstreams automation does not wait for: the opt-out audit (its own sensor launches the
# skip_lists runs it affects) and the semantic tables (optional to skip_lists; concepts run
# by hand, semantic_duplicates is automated once image_embeddings exist for every source).
NOT_AWAITED = dg.AssetSelection.assets(OPT_OUTS, SEMANTIC_DUPLICATES, CONCEPTS)
# Global steps whose tables record, per source, when its group rows last changed
# (`storage.changes.record_groups_changed`): skip_lists ignores their updates (one would
# start every source) and the group change sensor starts the sources that changed.
GROUP_STEPS = (DUPLICATES,)
GROUP_SENSOR = "group_change_sensor"


def automate(spec: dg.AssetSpec) -> dg.AssetSpec:
    """Materialise when an upstream partition was updated or the partition is missing,
    once no upstream is missing or running (`eager`), the upstreams of NOT_AWAITED (and
    GROUP_STEPS for skip_lists) aside."""
    ignored: dg.AssetSelection = NOT_AWAITED
    if spec.key == dg.AssetKey(SKIP_LISTS):
        ignored = ignored | dg.AssetSelection.assets(*GROUP_STEPS)
    return spec.replace_attributes(
        automation_condition=dg.AutomationCondition.eager().ignore(ignored))


def skip_lists_due(changed_at: Mapping[str, int], applied: Mapping[str, int | None],
                   sources: list[str]) -> list[str]:
    """The configured sources whose group rows changed (at `changed_at[source]`, a version
    of the global table) after the version their latest skip lists read (`applied`; None:
    never read), in configuration order."""
    def due(source: str) -> bool:
        read = applied.get(source)
        return source in changed_at and (read is None or read < changed_at[source])

    return [source for source in sources if due(source)]


def group_change_requests(instance: dg.DagsterInstance, changed_at: Mapping[str, Mapping[str, int]],
                          sources: list[str]) -> list[dg.RunRequest]:
    """One skip_lists run per source due for any of GROUP_STEPS (`changed_at`: step ->
    source -> version); its run key names the versions, so one change requests one run."""
    due: dict[str, list[str]] = {}
    for step, versions in changed_at.items():
        applied = {source: recorded_input_version(instance, SKIP_LISTS, source, step)
                   for source in sources if source in versions}
        for source in skip_lists_due(versions, applied, sources):
            due.setdefault(source, []).append(f"{step}@{versions[source]}")
    return [dg.RunRequest(run_key=f"groups:{source}:{','.join(steps)}", partition_key=source,
                          asset_selection=[dg.AssetKey(SKIP_LISTS)],
                          tags={TRIGGER_TAG: GROUP_SENSOR,
                                REASON_TAG: f"groups changed: {', '.join(steps)}"})
            for source, steps in due.items()]


def build_group_change_sensor(sources: SourcesConfig) -> dg.SensorDefinition:
    names = sources.names

    @dg.sensor(
        name=GROUP_SENSOR, target=dg.AssetSelection.assets(SKIP_LISTS),
        minimum_interval_seconds=30, default_status=_status(),
        description="Reads, per source, the version at which the global duplicates last "
                    "changed its group rows, and requests the skip_lists run of each source "
                    "whose latest skip lists read an older version (only those sources).")
    def group_change_sensor(context: dg.SensorEvaluationContext, storage: StorageResource
                            ) -> dg.SensorResult | dg.SkipReason:
        store = storage.get()
        changed_at = {step: groups_changed_at(store.table(step)) for step in GROUP_STEPS}
        requests = group_change_requests(context.instance, changed_at, names)
        if not requests:
            return dg.SkipReason("every source's skip lists read its latest group changes")
        return dg.SensorResult(run_requests=requests)

    return group_change_sensor


def automation_sensor() -> dg.AutomationConditionSensorDefinition:
    return dg.AutomationConditionSensorDefinition(
        "factory_automation", target=dg.AssetSelection.assets(*AUTOMATED),
        default_status=_status(), minimum_interval_seconds=30,
        description="Evaluates the automation conditions of the assets downstream of "
                    "raw_images and requests their runs (each evaluation is shown on the "
                    "asset's Automation tab).")


def fresh(spec: dg.AssetSpec) -> dg.AssetSpec:
    """The asset with FRESHNESS (for `map_resolved_asset_specs` over FRESH_ASSETS)."""
    return spec.replace_attributes(freshness_policy=FRESHNESS)


def failure_line(run_id: str, job: str, steps: list[tuple[str, str]], run_cause: str) -> str:
    """One line for a failed run: the first failing step and the first line of its error,
    or the run's own failure (a crash, a killed worker) when no step failed."""
    if steps:
        step, cause = steps[0]
        more = f" (+{len(steps) - 1} more failed step(s))" if len(steps) > 1 else ""
    else:
        step, cause, more = "(no step)", run_cause, ""
    text = (cause or "").strip()
    first = text.splitlines()[0] if text else "no message"
    return f"run {run_id} of {job} failed at step {step}: {first}{more}"


def describe_failure(context: dg.RunFailureSensorContext) -> str:
    """`failure_line` of the context's run: each failed step with its innermost error
    ("OSError: ...", the body's exception, not Dagster's wrapper around it)."""
    steps = []
    for event in context.get_step_failure_events():
        error = event.step_failure_data.error
        while error is not None and error.cause is not None:
            error = error.cause
        steps.append((event.step_key or "?", error.message if error is not None else ""))
    return failure_line(context.dagster_run.run_id, context.dagster_run.job_name, steps,
                        context.failure_event.message or "")


@dg.run_failure_sensor(name=FAILURE_SENSOR, default_status=dg.DefaultSensorStatus.RUNNING,
                       description="Logs one line per failed run: the failing step and its "
                                   "cause (the run's own failure when no step failed).")
def run_failure_reporter(context: dg.RunFailureSensorContext) -> None:
    context.log.error(describe_failure(context))


def factory_defs(sources: SourcesConfig) -> dg.Definitions:
    return dg.Definitions(
        sensors=[*(build_source_sensor(spec, sources.location_of(spec.name))
                   for spec in sources.sources), automation_sensor(),
                 build_group_change_sensor(sources), run_failure_reporter])
