"""The Ray-backed Lance IO manager.

Assets return a lazy `ray.data.Dataset`; this streams it into the partition's Lance table
with one atomic commit, and hands downstream assets a lazy Dataset pinned to the version
that was materialised.
"""


from collections.abc import Callable
from dataclasses import dataclass

import dagster as dg
import pyarrow as pa
import ray.data

from prx_assets.defs.metadata import PROFILERS, browser_link, materialized_lance_version
from prx_assets.defs.report import size_in_words
from prx_assets.defs.resources import StorageResource
from prx_assets.storage import lance_tables
from prx_assets.storage.lance_tables import FragmentPolicy, WriteReport
from prx_assets.storage.refs import TableRef

# Definition-metadata keys an asset may set to size its fragments.
FRAGMENT_BYTES_KEY = "prx/fragment_bytes"
FRAGMENT_ROWS_KEY = "prx/fragment_rows"
# Definition-metadata key naming a profiler in metadata.PROFILERS (tables for the UI).
PROFILE_KEY = "prx/profile"
# AssetIn-metadata key: the columns a downstream asset reads (projection pushdown).
COLUMNS_KEY = "prx/columns"


@dataclass
class LanceTableOutput:
    """A dataset plus its schema, for outputs that may be empty (schema can't be inferred)."""

    dataset: ray.data.Dataset
    schema: pa.Schema | None = None
    metadata: dict | None = None
    # Metadata computed from the committed table (at the version written), e.g. summaries.
    after_write: Callable[[TableRef], dict] | None = None


def table_metadata(table: TableRef, report: WriteReport,
                   profile: str | None = None) -> dict:
    """What a materialisation of a Lance table records: where, the version written (which
    downstream reads pin to), its size and fragments, and the profile named by `profile`
    (a key of metadata.PROFILERS). Shared by this IO manager and by assets that commit
    their table themselves (chunked, incremental runs)."""
    return {
        "path": dg.MetadataValue.path(table.uri),
        "lance_version": report.version,
        "dagster/row_count": report.rows,
        "table_bytes": report.bytes,
        "table_size": size_in_words(report.bytes),
        "fragments": report.fragments,
        "fragments_before_compaction": report.compacted_from,
        "mean_fragment_mb": round(report.bytes / max(1, report.fragments) / 1e6, 2),
        "ray_nodes": len(report.nodes),
        **(PROFILERS[profile](table.at(report.version)) if profile else {}),
    }


class RayLanceIOManager(dg.ConfigurableIOManager):
    """Per-partition Lance tables under `<data_root>/lance/<asset>/<partition>.lance`."""

    storage: StorageResource = StorageResource()
    fragment_bytes: int = lance_tables.DEFAULT_BLOB_FRAGMENT_BYTES
    fragment_rows: int = lance_tables.DEFAULT_METADATA_FRAGMENT_ROWS

    def table_for(self, context: dg.OutputContext | dg.InputContext) -> TableRef:
        partition = context.partition_key if context.has_partition_key else None
        return self.storage.get().table(context.asset_key.path[-1], partition)

    def handle_output(self, context: dg.OutputContext, obj) -> None:
        if obj is None:
            return
        output = obj if isinstance(obj, LanceTableOutput) else LanceTableOutput(obj)
        meta = context.definition_metadata or {}
        policy = FragmentPolicy(
            target_bytes=int(meta.get(FRAGMENT_BYTES_KEY, self.fragment_bytes)),
            max_rows=int(meta.get(FRAGMENT_ROWS_KEY, self.fragment_rows)),
        )
        table = self.table_for(context)
        report = lance_tables.write_dataset_atomically(output.dataset, table, policy,
                                                       output.schema)
        context.log.info(
            f"committed {report.rows:,} rows to {table} as version {report.version} "
            f"({report.fragments} fragment(s), compacted from {report.compacted_from})"
        )
        context.add_output_metadata({
            **table_metadata(table, report, meta.get(PROFILE_KEY)),
            **(output.metadata or {}),
            **browser_link(context),
            **(output.after_write(table.at(report.version)) if output.after_write else {}),
        })

    def load_input(self, context: dg.InputContext) -> ray.data.Dataset:
        """A lazy read of the upstream partition, pinned to the version that was
        materialised (so a concurrent rewrite cannot change what this run reads)."""
        partition = context.asset_partition_key if context.has_asset_partitions else None
        table = self.storage.get().table(context.asset_key.path[-1], partition)
        if not table.exists():
            raise dg.Failure(f"upstream table {table} does not exist; materialise it first")
        version = materialized_lance_version(context.instance, context.asset_key, partition)
        columns = (context.definition_metadata or {}).get(COLUMNS_KEY)
        return table.at(version).read(columns=columns)
