"""Rows whose file left the source: found by comparing the table's (unit, signature) with
the listing, deleted in one commit after the run's upserts, within a limit (a source half
gone is more often a mount or a bucket policy gone wrong than a curation)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc
import ray.data

from prx_assets.engine.batches import arrow_batches
from prx_assets.engine.chunked import CommitTarget, hash_partitions
from prx_assets.stages.ingest.raw_rows import UNIT_KEYS
from prx_assets.storage.filters import in_filter

if TYPE_CHECKING:
    from prx_assets.stages.ingest.ingest import IngestPlan

# A run may remove up to this share of the table's rows...
MAX_REMOVED_SHARE = 0.10
# ...and always this many: a handful of files deleted from a small source is a curation,
# and a share of a tiny table says little.
REMOVAL_FLOOR_ROWS = 100


class RemovalLimitError(RuntimeError):
    """The run would remove more of the source's rows than its configured share allows;
    nothing was removed (the rows it read are committed)."""


def stale_ids(target: CommitTarget, listed: dict[str, str]) -> list[str]:
    """Ids of rows whose (unit, signature) the listing no longer has."""
    if target.version() is None:
        return []
    units = pa.array(list(listed), pa.string())
    signatures = pa.array(list(listed.values()), pa.string())
    stale: list[str] = []
    for batch in target.open().to_batches(columns=["id", "unit", "unit_signature"],
                                          batch_size=65536):
        listed_signature = pc.take(signatures, pc.index_in(batch.column("unit"), units))
        current = pc.fill_null(pc.equal(listed_signature, batch.column("unit_signature")),
                               False)
        stale.extend(batch.column("id").filter(pc.invert(current)).to_pylist())
    return stale


def stale_ids_joined(target: CommitTarget, listed: ray.data.Dataset, n_listed: int
                     ) -> list[str]:
    """`stale_ids` for a big table: the table's (unit, signature) anti-joined in Ray with
    the listing; only the stale ids come back to the driver."""
    if target.version() is None:
        return []
    rows = target.table.latest().read(columns=["id", *UNIT_KEYS])
    # ignore: Ray annotates `on` as Tuple[str] (one column), though a join takes several.
    stale = rows.join(listed, join_type="left_anti", on=UNIT_KEYS,  # type: ignore[arg-type]
                      num_partitions=hash_partitions(max(n_listed, target.open().count_rows())))
    # A join's output may hold large_string: read the ids whatever their string type.
    return [id_ for batch in arrow_batches(stale.select_columns(["id"]))
            for id_ in batch.column("id").to_pylist()]


@dataclass(frozen=True)
class RemovalLimit:
    """How many rows one run may delete: up to `floor_rows`, or up to `share` of the table."""

    share: float = MAX_REMOVED_SHARE
    floor_rows: int = REMOVAL_FLOOR_ROWS

    def allows(self, removed: int, rows: int) -> bool:
        return removed <= max(self.floor_rows, self.share * rows)


def delete_stale_rows(target: CommitTarget, plan: IngestPlan,
                      limit: RemovalLimit = RemovalLimit()) -> int:
    """Delete rows the source no longer holds, in one commit; returns how many. More than
    the limit allows raises `RemovalLimitError` and deletes none."""
    ids = plan.stale_ids(target)
    if not ids:
        return 0
    table = target.open()
    rows = table.count_rows()
    if not limit.allows(len(ids), rows):
        raise RemovalLimitError(
            f"{target.table}: this run would remove {len(ids):,} of {rows:,} rows "
            f"({len(ids) / rows:.0%}), more than the allowed {limit.share:.0%} "
            f"({plan.units_listed:,} unit(s) listed at {plan.location.uri}); nothing was "
            "removed. If the files are really gone, rerun with a higher `max_removed_share` "
            "(1.0 allows any removal).")
    table.delete(in_filter("id", ids))
    return len(ids)
