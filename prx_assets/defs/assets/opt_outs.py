"""opt_outs: every request file parsed and resolved to the ids it removes (the audit trail)."""

from collections import Counter

import dagster as dg
import pyarrow as pa
import ray.data

from prx_assets.s6_opt_outs.opt_outs import (
    AUDIT_SCHEMA, ParsedRequests, opt_out_dir, parse_directory, resolve)
from prx_assets.storage.settings import data_root
from prx_assets.defs.io_managers import FRAGMENT_ROWS_KEY, LanceTableOutput
from prx_assets.defs.metadata import counts_table
from prx_assets.defs.resources import RayResource, SourcesResource

# Metadata tables stay readable in the UI; the Lance table holds everything.
MAX_METADATA_ROWS = 200


def build_opt_outs() -> dg.AssetsDefinition:
    @dg.asset(
        deps=[dg.AssetDep("raw_images", partition_mapping=dg.AllPartitionMapping()),
              "duplicates"],
        io_manager_key="lance_io_manager",
        group_name="dedup",
        kinds={"lance"},
        metadata={FRAGMENT_ROWS_KEY: 1 << 20},
        description="Audit trail of opt-out requests ($PRX_DATA_ROOT/opt_outs/*.csv|*.jsonl): "
                    "one row per request and id it removes (directly, same bytes, or phash "
                    "duplicate in any source); malformed rows are listed in metadata.",
    )
    def opt_outs(context: dg.AssetExecutionContext, ray_cluster: RayResource,
                 sources: SourcesResource) -> LanceTableOutput:
        parsed = parse_directory(opt_out_dir(data_root()))
        for error in parsed.errors:
            context.log.warning(f"malformed opt-out row {error}")
        audit = resolve(parsed.requests, sources.load().names, data_root())
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
