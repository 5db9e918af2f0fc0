"""opt_outs: every request file parsed and resolved to the ids it removes (the audit trail),
and the sensor that turns new request files into skip-list runs for exactly the sources hit."""

import hashlib
import json
from collections import Counter

import dagster as dg
import pyarrow as pa
import ray.data

from prx_assets.defs.io_managers import FRAGMENT_ROWS_KEY, LanceTableOutput
from prx_assets.defs.metadata import counts_table
from prx_assets.defs.resources import RayResource, SourcesResource, StorageResource
from prx_assets.stages.ingest.sources import load_sources
from prx_assets.stages.opt_outs.opt_outs import (
    AUDIT_SCHEMA,
    ParsedRequests,
    affected_sources,
    fingerprint,
    opt_out_dir,
    parse_directory,
    request_files,
    resolve,
)
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
        store = storage.get()
        parsed = parse_directory(opt_out_dir(store))
        for error in parsed.errors:
            context.log.warning(f"malformed opt-out row {error}")
        audit = resolve(parsed.requests, sources.load().names, store)
        return LanceTableOutput(ray.data.from_arrow(audit), AUDIT_SCHEMA,
                                metadata=audit_metadata(parsed, audit))

    return opt_outs


def audit_metadata(parsed: ParsedRequests, audit: pa.Table) -> dict:
    rows = audit.to_pylist()
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
              for e in parsed.errors[:MAX_METADATA_ROWS]]
    return {
        "requests": len(parsed.requests),
        "malformed_rows": len(parsed.errors),
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


def build_opt_out_sensor(sources_file: str) -> dg.SensorDefinition:
    @dg.sensor(
        name="opt_out_sensor",
        target=dg.AssetSelection.assets(SKIP_LISTS, OPT_OUTS),
        minimum_interval_seconds=60,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description="Watches $PRX_DATA_ROOT/opt_outs/ for new or changed request files, "
                    "resolves them, and requests skip_lists runs for exactly the sources "
                    "whose images they remove (plus one run refreshing the opt_outs audit).",
    )
    def opt_out_sensor(context: dg.SensorEvaluationContext, storage: StorageResource):
        seen = json.loads(context.cursor) if context.cursor else {}
        store = storage.get()
        folder = opt_out_dir(store)
        current = {file.name: fingerprint(file) for file in request_files(folder)}
        new = {name: fp for name, fp in current.items() if seen.get(name) != fp}
        if not new:
            return dg.SkipReason(f"no new opt-out request files in {folder}")
        parsed = parse_directory(folder, names=new)
        for error in parsed.errors:
            context.log.warning(f"malformed opt-out row {error}")
        audit = resolve(parsed.requests, load_sources(sources_file).names, store)
        sources = affected_sources(audit)
        context.log.info(f"{len(parsed.requests)} new request(s) in {', '.join(sorted(new))} "
                         f"affect: {', '.join(sources) or 'no source'}")
        batch = hashlib.sha256(json.dumps(new, sort_keys=True).encode()).hexdigest()[:12]
        runs = [dg.RunRequest(run_key=f"opt_outs:{batch}",
                              asset_selection=[dg.AssetKey(OPT_OUTS)])]
        runs += [dg.RunRequest(run_key=f"skip_lists:{source}:{batch}", partition_key=source,
                               asset_selection=[dg.AssetKey(SKIP_LISTS)],
                               tags={"prx/opt_out_files": ",".join(sorted(new))})
                 for source in sources]
        return dg.SensorResult(run_requests=runs, cursor=json.dumps({**seen, **new}))

    return opt_out_sensor


def opt_out_defs(sources_file: str) -> dg.Definitions:
    return dg.Definitions(assets=[build_opt_outs()], sensors=[build_opt_out_sensor(sources_file)])
