"""opt_outs: every request file resolved to the ids it removes (the audit trail, written by
`resolve_opt_outs`), and the sensor that turns new request files into skip-list runs for
exactly the sources hit."""

import hashlib
import json
from collections import Counter

import dagster as dg
import ray.data

from prx_assets.defs.io_managers import FRAGMENT_ROWS_KEY, LanceTableOutput
from prx_assets.defs.metadata import counts_table
from prx_assets.defs.resources import RayResource, SourcesResource, StorageResource
from prx_assets.stages.ingest.sources import load_sources
from prx_assets.stages.opt_outs.opt_outs import affected_sources
from prx_assets.stages.opt_outs.requests import request_fingerprints
from prx_assets.stages.opt_outs.resolution import Resolution, resolve_opt_outs
from prx_assets.stages.opt_outs.rights import rules_fingerprint
from prx_assets.storage.tables import DUPLICATES, OPT_OUTS, RAW_IMAGES, SKIP_LISTS

# Metadata tables stay readable in the UI; the Lance table holds everything.
MAX_METADATA_ROWS = 200


def build_opt_outs() -> dg.AssetsDefinition:
    @dg.asset(
        name=OPT_OUTS,
        deps=[dg.AssetDep(RAW_IMAGES, partition_mapping=dg.AllPartitionMapping()),
              DUPLICATES],
        io_manager_key="lance_io_manager",
        group_name="dedup",
        kinds={"lance"},
        metadata={FRAGMENT_ROWS_KEY: 1 << 20},
        description="Audit trail of opt-out requests ($PRX_DATA_ROOT/opt_outs/*.csv|*.jsonl): "
                    "one row per request and id it removes (directly, same bytes, or phash "
                    "duplicate in any source); malformed rows are listed in metadata.",
    )
    def opt_outs(context: dg.AssetExecutionContext, ray_cluster: RayResource,
                 sources: SourcesResource, storage: StorageResource) -> LanceTableOutput:
        resolution = resolve_opt_outs(storage.get(), sources.load().names)
        for error in resolution.errors:
            context.log.warning(f"malformed opt-out row {error}")
        # The schema carries what was resolved: readers take these rows from the table and
        # resolve only the request files it does not cover.
        return LanceTableOutput(ray.data.from_arrow(resolution.audit), resolution.schema,
                                metadata=audit_metadata(resolution))

    return opt_outs


def audit_metadata(resolution: Resolution) -> dict:
    rows = resolution.audit.to_pylist()
    removed = [r for r in rows if r["id"] is not None]
    per_request: dict[str, dict] = {}
    for row in rows:
        entry = per_request.setdefault(row["request_id"], {
            "request": row["request_id"], "key_type": row["key_type"], "value": row["value"],
            "reference": row["reference"] or "", "ids_removed": 0, "sources": set()})
        if row["id"] is not None:
            entry["ids_removed"] += 1
            entry["sources"].add(row["source"])
    requests = [dg.TableRecord({**e, "sources": ", ".join(sorted(e["sources"]))})
                for e in list(per_request.values())[:MAX_METADATA_ROWS]]
    errors = [dg.TableRecord({"file": e.file, "line": e.line, "problem": e.message})
              for e in resolution.errors[:MAX_METADATA_ROWS]]
    return {
        "requests": resolution.requests,
        "malformed_rows": len(resolution.errors),
        "ids_removed": len({r["id"] for r in removed}),
        "removed_per_source": counts_table(Counter(r["source"] for r in removed), "source"),
        "removed_by_way": counts_table(Counter(r["via"] for r in removed), "via"),
        "per_request": dg.MetadataValue.table(requests, schema=dg.TableSchema(columns=[
            dg.TableColumn(c, "int" if c == "ids_removed" else "string")
            for c in ("request", "key_type", "value", "reference", "ids_removed", "sources")])),
        "malformed": dg.MetadataValue.table(errors, schema=dg.TableSchema(columns=[
            dg.TableColumn("file", "string"), dg.TableColumn("line", "int"),
            dg.TableColumn("problem", "string")])),
    }


RUN_KEY_TAG = "dagster/run_key"  # Dagster tags every run a sensor requests with its key
IN_FLIGHT = frozenset({dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED,
                       dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED,
                       dg.DagsterRunStatus.CANCELING})


def read_cursor(cursor: str | None) -> tuple[dict[str, str], dict | None]:
    """(request files applied: name -> fingerprint, the batch whose runs are pending).
    A cursor of the older layout (a bare name -> fingerprint map) counts as applied."""
    state = json.loads(cursor) if cursor else {}
    if "done" not in state:
        return state, None
    return state["done"], state.get("pending")


def write_cursor(done: dict[str, str], pending: dict | None) -> str:
    return json.dumps({"done": done, "pending": pending}, sort_keys=True)


def run_status(instance: dg.DagsterInstance, run_key: str) -> dg.DagsterRunStatus | None:
    """The status of the latest run requested under `run_key`, None if there is none."""
    runs = instance.get_runs(filters=dg.RunsFilter(tags={RUN_KEY_TAG: run_key}), limit=1)
    return runs[0].status if runs else None


def batch_requests(batch: str, sources: list[str], files: list[str]) -> list[dict]:
    """The runs one batch of request files needs: the audit, and skip lists per source hit."""
    specs: list[dict] = [{"run_key": f"opt_outs:{batch}", "asset": OPT_OUTS, "partition": None}]
    return specs + [{"run_key": f"skip_lists:{source}:{batch}", "asset": SKIP_LISTS,
                     "partition": source, "files": ",".join(files)} for source in sources]


def run_request(spec: dict) -> dg.RunRequest:
    tags = {"prx/opt_out_files": spec["files"]} if spec.get("files") else None
    return dg.RunRequest(run_key=spec["run_key"], partition_key=spec["partition"],
                         asset_selection=[dg.AssetKey(spec["asset"])], tags=tags)


def follow_up(instance: dg.DagsterInstance, pending: dict) -> tuple[list[dict], bool]:
    """(runs to request again, whether every run of the batch succeeded). A failed or
    cancelled run is requested again under a new key (a key names one run); a run not
    created yet is requested again under its own key (Dagster dedups by key); one in
    flight is waited for."""
    again, succeeded = [], True
    for spec in pending["runs"]:
        status = run_status(instance, spec["run_key"])
        if status == dg.DagsterRunStatus.SUCCESS:
            continue
        succeeded = False
        if status is None:
            again.append(spec)
        elif status not in IN_FLIGHT:
            again.append({**spec, "run_key": f"{_first_key(spec)}#{pending['attempt'] + 1}"})
    return again, succeeded


def retried(pending: dict, again: list[dict]) -> dict:
    """The pending batch with the runs requested again in place of their earlier tries
    (the attempt counts up when one of them is a new try of a failed run)."""
    replaced = {_first_key(spec): spec for spec in again}
    earlier = {spec["run_key"] for spec in pending["runs"]}
    new_try = any(spec["run_key"] not in earlier for spec in again)
    return {**pending, "attempt": pending["attempt"] + int(new_try),
            "runs": [replaced.get(_first_key(spec), spec) for spec in pending["runs"]]}


def _first_key(spec: dict) -> str:
    """The run key of a batch's run before any retry suffix (`#<attempt>`)."""
    return spec["run_key"].split("#", 1)[0]


def build_opt_out_sensor(sources_file: str) -> dg.SensorDefinition:
    @dg.sensor(
        name="opt_out_sensor",
        target=dg.AssetSelection.assets(SKIP_LISTS, OPT_OUTS),
        minimum_interval_seconds=60,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description="Watches $PRX_DATA_ROOT/opt_outs/ for new or changed request files, "
                    "resolves them, and requests skip_lists runs for exactly the sources "
                    "whose images they remove (plus one run refreshing the opt_outs audit). "
                    "A batch counts as applied only once every run it requested succeeded; "
                    "a failed run is requested again.",
    )
    def opt_out_sensor(context: dg.SensorEvaluationContext, storage: StorageResource):
        done, pending = read_cursor(context.cursor)
        if pending is not None:
            again, succeeded = follow_up(context.instance, pending)
            if not succeeded:
                if not again:
                    return dg.SkipReason("waiting for the opt-out runs in flight: "
                                         + ", ".join(s["run_key"] for s in pending["runs"]))
                context.log.warning("opt-out runs not yet successful, requested again: "
                                    + ", ".join(s["run_key"] for s in again))
                pending = retried(pending, again)
                return dg.SensorResult(run_requests=[run_request(s) for s in again],
                                       cursor=write_cursor(done, pending))
            done = {**done, **pending["files"]}
            pending = None
        store = storage.get()
        folder = store.opt_outs_dir
        new = {name: stamp for name, stamp in request_fingerprints(folder).items()
               if done.get(name) != stamp}
        if not new:
            return dg.SensorResult(skip_reason=f"no new opt-out request files in {folder}",
                                   cursor=write_cursor(done, None))
        resolution = resolve_opt_outs(store, load_sources(sources_file).names)
        new = {name: resolution.record.files.get(name, stamp) for name, stamp in new.items()}
        for error in resolution.errors:
            if error.file in new:
                context.log.warning(f"malformed opt-out row {error}")
        audit = resolution.of_files(new)
        sources = affected_sources(audit)
        requests = len(set(audit.column("request_id").to_pylist()))
        context.log.info(f"{requests} new request(s) in {', '.join(sorted(new))} "
                         f"affect: {', '.join(sources) or 'no source'}")
        batch = hashlib.sha256(json.dumps(new, sort_keys=True).encode()).hexdigest()[:12]
        specs = batch_requests(batch, sources, sorted(new))
        pending = {"files": new, "runs": specs, "attempt": 0}
        return dg.SensorResult(run_requests=[run_request(s) for s in specs],
                               cursor=write_cursor(done, pending))

    return opt_out_sensor


def build_rights_sensor(sources_file: str) -> dg.SensorDefinition:
    @dg.sensor(
        name="rights_sensor",
        target=dg.AssetSelection.assets(SKIP_LISTS),
        minimum_interval_seconds=60,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description="Watches $PRX_DATA_ROOT/rights/ (the reserved domain lists and the "
                    "curators' clearances) and requests a skip_lists run of every source "
                    "when they change, so the sidecars' `rights` lists follow them "
                    "(docs/rights.md). The loader's guard applies them at once anyway.",
    )
    def rights_sensor(context: dg.SensorEvaluationContext, storage: StorageResource):
        stamp = rules_fingerprint(storage.get())
        if stamp == context.cursor:
            return dg.SensorResult(skip_reason="the domain lists and clearances are unchanged",
                                   cursor=stamp)
        sources = load_sources(sources_file).names
        context.log.info(f"rights rules changed ({stamp}): skip lists of {', '.join(sources)}")
        return dg.SensorResult(cursor=stamp, run_requests=[
            dg.RunRequest(run_key=f"rights:{source}:{stamp}", partition_key=source,
                          asset_selection=[dg.AssetKey(SKIP_LISTS)]) for source in sources])

    return rights_sensor


def opt_out_defs(sources_file: str) -> dg.Definitions:
    return dg.Definitions(assets=[build_opt_outs()],
                          sensors=[build_opt_out_sensor(sources_file),
                                   build_rights_sensor(sources_file)])
