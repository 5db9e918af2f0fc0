"""duplicates: exact phash duplicates across every source (one global table)."""

from typing import Any

import dagster as dg

from prx_assets.defs.io_managers import (
    FRAGMENT_BYTES_KEY,
    FRAGMENT_ROWS_KEY,
    LanceTableOutput,
    table_metadata,
)
from prx_assets.defs.metadata import input_lineage
from prx_assets.defs.resources import RayResource, SourcesResource, StorageResource
from prx_assets.stages.dedup.dedup import (
    DEFAULT_ROWS_PER_BUCKET,
    DUPLICATES_SCHEMA,
    duplicates_dataset,
    hash_inputs,
    hashed_rows,
    near_duplicate_report,
    summarise,
)
from prx_assets.stages.dedup.incremental import (
    DEFAULT_MAX_CHANGED_SHARE,
    incremental_duplicates,
    record_inputs,
)
from prx_assets.storage.changes import groups_changed_at, record_groups_changed
from prx_assets.storage.lance_tables import describe_write
from prx_assets.storage.refs import TableRef
from prx_assets.storage.tables import DUPLICATES, PHASHES


class DuplicatesConfig(dg.Config):
    rows_per_bucket: int = DEFAULT_ROWS_PER_BUCKET
    # The near-duplicate share is an estimate, reported and never acted on.
    near_duplicate_probes: int = 256
    near_duplicate_max_rows: int = 5_000_000
    near_duplicate_max_distance: int = 4
    # Update the groups the phashes' changes since the last run touch (a full run when
    # those cannot be told: no record, sources reordered, a compaction, too many changes).
    incremental: bool = True
    max_changed_share: float = DEFAULT_MAX_CHANGED_SHARE


def build_duplicates() -> dg.AssetsDefinition:
    @dg.asset(
        name=DUPLICATES,
        deps=[dg.AssetDep(PHASHES, partition_mapping=dg.AllPartitionMapping())],
        io_manager_key="lance_io_manager",
        group_name="dedup",
        kinds={"ray", "lance"},
        code_version="1",
        metadata={FRAGMENT_ROWS_KEY: 1 << 20, FRAGMENT_BYTES_KEY: 1 << 30},
        description="Every member of every group of identical phashes across all sources "
                    "(flat images excluded), with the copy kept: most pixels, then source "
                    "order, then id. Non-kept copies are skipped by skip_lists.",
    )
    def duplicates(context: dg.AssetExecutionContext, config: DuplicatesConfig,
                   ray_cluster: RayResource, sources: SourcesResource,
                   storage: StorageResource) -> dg.Output[Any]:
        names = sources.load().names
        store = storage.get()
        inputs, missing = hash_inputs(store, names)
        if missing:
            context.log.warning(f"no phashes table yet for {', '.join(missing)}: not deduplicated")
        totals = hashed_rows(inputs)
        near = near_duplicate_report(inputs, config.near_duplicate_probes,
                                     config.near_duplicate_max_rows,
                                     config.near_duplicate_max_distance)
        recorded = {**input_lineage({f"{PHASHES}/{i.source}": i.version for i in inputs}),
                    "sources_missing": ", ".join(missing) or "none",
                    "near_duplicate_share": _near_table(near)}
        target = store.table(DUPLICATES)
        update = (incremental_duplicates(inputs, target, config.max_changed_share)
                  if config.incremental else None)
        if update is not None:
            context.log.info(f"{update.changed_rows:,} hashed rows changed: the groups of "
                             f"{update.hashes:,} hashes rewritten ({update.rows_rewritten:,} rows)")
            written = target.at(update.version)
            metadata: dict[str, Any] = {
                **table_metadata(written, describe_write(written.open())), **recorded,
                "run": "incremental", "hashes_rechecked": update.hashes,
                "changed_rows": update.changed_rows,
                "sources_changed": ", ".join(update.sources_changed) or "none",
                **_groups_metadata(target), **_summary_metadata(written, totals)}
            # Written already: the IO manager writes nothing for None.
            return dg.Output(None, metadata=metadata)
        context.log.info(f"grouping {sum(totals.values()):,} hashes from {len(inputs)} source(s)")

        def after_write(table: TableRef) -> dict:
            # A full run cannot tell whose groups changed: every source's skip lists are due.
            record_groups_changed(table, [i.source for i in inputs], table.open().version)
            record_inputs(table, inputs)  # what the next run's update starts from
            return {"run": "full", "sources_changed": "all", **_groups_metadata(table),
                    **_summary_metadata(table, totals)}

        return dg.Output(LanceTableOutput(
            duplicates_dataset(inputs, config.rows_per_bucket), DUPLICATES_SCHEMA,
            metadata=recorded, after_write=after_write))

    return duplicates


def _groups_metadata(table: TableRef) -> dict:
    """Per source, the version at which its group rows last changed (its skip lists are
    due until they read at least that version)."""
    return {"groups_changed_at": dg.MetadataValue.json(groups_changed_at(table))}


def _summary_metadata(table: TableRef, totals: dict[str, int]) -> dict:
    summary = summarise(table, totals)
    per_source = [
        dg.TableRecord({"source": source, "hashed": total,
                        "removed": summary.removed_per_source.get(source, 0),
                        "share": round(summary.removed_per_source.get(source, 0) / total, 4)
                        if total else 0.0})
        for source, total in totals.items()]
    largest = [dg.TableRecord(group) for group in summary.largest]
    return {
        "duplicate_groups": summary.groups,
        "removed": sum(summary.removed_per_source.values()),
        "removed_per_source": dg.MetadataValue.table(per_source, schema=dg.TableSchema(columns=[
            dg.TableColumn("source", "string"), dg.TableColumn("hashed", "int"),
            dg.TableColumn("removed", "int"), dg.TableColumn("share", "float")])),
        "largest_groups": dg.MetadataValue.table(largest, schema=dg.TableSchema(columns=[
            dg.TableColumn("phash", "string"), dg.TableColumn("group_size", "int"),
            dg.TableColumn("kept_id", "string")])),
    }


def _near_table(shares: dict[int, float]) -> dg.TableMetadataValue:
    records = [dg.TableRecord({"hamming_distance_at_most": d, "share": round(s, 4)})
               for d, s in shares.items()]
    return dg.MetadataValue.table(records, schema=dg.TableSchema(columns=[
        dg.TableColumn("hamming_distance_at_most", "int"), dg.TableColumn("share", "float")]))


def dedup_defs() -> dg.Definitions:
    return dg.Definitions(assets=[build_duplicates()])
