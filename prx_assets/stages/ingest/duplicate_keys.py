"""A key in two units of one source: the unit first by name keeps it, every other unit's
row becomes a `duplicate_key` row of its own unit naming both (before, the unit read later
won silently), within a chunk, across chunks and across runs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from prx_assets.engine.chunked import AbsentRows, CommitTarget
from prx_assets.engine.stage import NODE_COLUMN
from prx_assets.stages.ingest import readers
from prx_assets.stages.ingest.ids import sample_id
from prx_assets.stages.ingest.raw_rows import UNIT_KEYS
from prx_assets.storage.filters import in_filter


def rows_to_commit(chunk: pa.Table, committed: CommittedRivals | None = None
                   ) -> pa.Table | AbsentRows:
    """A chunk as it is merge-inserted: without the node column, and with one row per id
    (a merge-insert refuses two source rows for one key). A key found in two units of a
    source keeps the row of the unit first by name (whatever order Ray read them in); each
    other one becomes a `duplicate_key` row of its own unit naming both units (before, the
    unit read later won silently). With `committed`, the units of earlier chunks and runs
    are compared too (`CommittedRivals`), and a chunk none of whose ids is committed yet
    comes back as `AbsentRows` (appended, not merged)."""
    if NODE_COLUMN in chunk.column_names:
        chunk = chunk.drop_columns([NODE_COLUMN])
    ids = chunk.column("id")
    if pc.count_distinct(ids).as_py() != chunk.num_rows:
        chunk = _first_unit_per_key(chunk)
    return committed.resolve(chunk) if committed is not None else chunk


def _first_unit_per_key(chunk: pa.Table) -> pa.Table:
    rows = chunk.to_pylist()
    kept: dict[str, str] = {}  # id -> the unit whose row is kept: the first by name
    for row in rows:
        unit = row.get("unit") or ""
        kept[row["id"]] = min(unit, kept.get(row["id"], unit))
    for row in rows:  # a unit repeats no key (`_unit_rows`): a repeat is another unit's
        if (row.get("unit") or "") != kept[row["id"]]:
            _mark_duplicate(row, kept[row["id"]])
    return pa.Table.from_pylist(rows, schema=chunk.schema)


@dataclass
class CommittedRivals:
    """A chunk's keys against the rows already committed: a row of the same id from
    another unit that the listing still holds under its committed signature is a rival
    (a unit re-read, or one gone from the listing, is not: its rows are replaced or
    removed by this run). The unit first by name keeps the key, as within a chunk: a
    chunk's row of a later unit becomes its `duplicate_key` row; a committed row of a
    later unit is rewritten as one, in the same commit, so that unit still counts as read
    whole. One lookup of the chunk's ids per chunk (a filter on the key index); a chunk it
    finds none of (new files) is `AbsentRows`: appended, no merge looks them up again."""

    target: CommitTarget
    signature_of: Callable[[list[str]], dict[str, str]]  # units -> listed signature

    def resolve(self, chunk: pa.Table) -> pa.Table | AbsentRows:
        if self.target.version() is None or chunk.num_rows == 0:
            return chunk
        ids = chunk.column("id").to_pylist()
        committed = self.target.open()
        found = committed.to_table(columns=["id", *UNIT_KEYS], filter=in_filter("id", ids))
        if found.num_rows == 0:
            return AbsentRows(chunk, committed.version)
        units = dict(zip(chunk.column("id").to_pylist(), chunk.column("unit").to_pylist(),
                         strict=True))
        others = [(i, u, s) for i, u, s in zip(found["id"].to_pylist(),
                                               found["unit"].to_pylist(),
                                               found["unit_signature"].to_pylist(), strict=True)
                  if u != units[i]]
        listed = self.signature_of(sorted({u for _, u, _ in others})) if others else {}
        rivals = {i: u for i, u, s in others if listed.get(u) == s}
        if not rivals:
            return chunk
        rows = chunk.to_pylist()
        for row in rows:
            if row["id"] in rivals and rivals[row["id"]] < (row.get("unit") or ""):
                _mark_duplicate(row, rivals[row["id"]])
        beaten = {row["id"]: row["unit"] for row in rows
                  if row["id"] in rivals and row["status"] != readers.STATUS_DUPLICATE_KEY}
        if beaten:
            for old in self.target.open().to_table(filter=in_filter("id", list(beaten))
                                                   ).to_pylist():
                _mark_duplicate(old, beaten[old["id"]])
                rows.append({name: old.get(name) for name in chunk.schema.names})
        return pa.Table.from_pylist(rows, schema=chunk.schema)


def _mark_duplicate(row: dict, first_unit: str) -> None:
    """`row`, whose key an earlier unit of the chunk holds, as a `duplicate_key` row of its
    own unit (its unit and signature kept, so the unit still counts as read whole)."""
    key, unit = row["source_key"], row.get("unit") or ""
    row.update(id=sample_id(row["source"], f"{unit}#{key}"), source_key=f"{unit}#{key}",
               image=None, format=None, width=None, height=None,
               status=readers.STATUS_DUPLICATE_KEY,
               error=f"key {key!r} of unit {unit!r} is also in unit {first_unit!r}: keys must "
                     "be unique in a source; the first unit's row is kept")
