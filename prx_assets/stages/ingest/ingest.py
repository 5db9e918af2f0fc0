"""Ingest a source into its `raw_images` table, incrementally and resumably.

1. **List** the source's units (files, tars, parquet files, Lance fragments) with what the
   listing says of each (`unit_signature`: size and mtime, or the Lance version).
2. **Compare** with the committed table: a unit is done when its rows carry the listed
   signature and are all there (`unit_items`, on a unit's last row, says how many). Units
   not done (new, changed, or cut off by a killed run) are pending; the driver hands them
   to Ray in bounded in-memory blocks (no manifest file, so nothing is written to the
   driver's disk and every node of a cluster can read them).
3. **Read** the pending units in Ray tasks, streaming from the file system (local or
   object store), and merge-insert the rows in chunks keyed on `id` through the shared
   runner (`engine.chunked.run_chunked`): a kill keeps every committed chunk, a re-read
   unit replaces its rows, ids stay unique at every version.
4. **Delete** rows whose (unit, signature) is no longer listed, in one commit after the
   upserts: files gone from the source, and members gone from a changed tar or parquet
   file (only identifiable once the unit's surviving rows carry its new signature).

Deletes act only on a complete listing: a folder or prefix that cannot be listed fails the
run before anything is written (`readers.ListingError`), and a run that would delete more
than `IngestOptions.max_removed_share` of the table stops before its delete
(`RemovalLimitError`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import ray
import ray.data
from ray.data.aggregate import Count, Max

from prx_assets.engine.batches import PutTable, arrow_batches, dataset_of, put_table
from prx_assets.engine.chunked import (
    BROADCAST_IDS,
    AbsentRows,
    ChunkedReport,
    ChunkedRun,
    CommitTarget,
    hash_partitions,
    run_chunked,
)
from prx_assets.engine.stage import NODE_COLUMN, with_node_column
from prx_assets.stages.ingest import readers
from prx_assets.stages.ingest.ids import sample_id
from prx_assets.stages.ingest.location import SourceLocation
from prx_assets.stages.ingest.probe import DEFAULT_MAX_PIXELS
from prx_assets.stages.ingest.raw_rows import (
    DEFAULT_MAX_CAPTION_BYTES,
    RAW_IMAGES_SCHEMA,
    UNIT_COLUMNS,
    FoundItem,
    raw_row,
    rows_to_tables,
)
from prx_assets.stages.ingest.sources import SourceSpec
from prx_assets.storage.failpoints import failpoint
from prx_assets.storage.filters import in_filter
from prx_assets.storage.lance_tables import create_empty, overwrite_rows, tag_with_node

# Units per in-memory block handed to Ray (a block is a few hundred KB of paths).
UNIT_BLOCK = 10_000
UNIT_KEYS = ("unit", "unit_signature")
# Up to this many rows the comparison runs on the driver (as engine.chunked broadcasts up to
# a million ids); past it, in Ray hash joins.
DRIVER_COMPARE_ROWS = BROADCAST_IDS
UNIT_FIELDS = pa.schema([pa.field("unit", pa.string()), pa.field("unit_signature", pa.string())])


@dataclass(frozen=True, kw_only=True)  # by name: the fields grow, positions would shift
class IngestOptions:
    max_pixels: int = DEFAULT_MAX_PIXELS
    max_file_bytes: int = readers.DEFAULT_MAX_FILE_BYTES
    max_caption_bytes: int = DEFAULT_MAX_CAPTION_BYTES
    units_per_task: int = 64  # files per task for image folders; tars/parquet go one by one
    chunk_rows: int = 1024  # rows per merge-insert commit
    # A run that would delete more than this share of the table's rows stops instead: a
    # source half gone is more often a mount or a bucket policy gone wrong than a curation.
    max_removed_share: float = 0.10
    # ...except that a run may always remove this many rows: a handful of files deleted from
    # a small source is a curation, and a share of a tiny table says little.
    removal_floor_rows: int = 100
    # Read the training reservations (stages/ingest/rights.py); off only for the bench's
    # baseline: rows then say "none" whatever the images carry.
    read_rights: bool = True


class RemovalLimitError(RuntimeError):
    """The run would remove more of the source's rows than its configured share allows;
    nothing was removed (the rows it read are committed)."""


# ------------------------------------------------------------------ listing and comparing

def list_source(spec: SourceSpec, location: SourceLocation) -> Iterator[tuple[str, str]]:
    """(unit, signature) of every unit of the source, streaming."""
    if spec.kind == "lance":
        return readers.lance_unit_entries(spec, location)
    return readers.list_unit_entries(spec, location)


def completed_units(target: CommitTarget) -> dict[str, str]:
    """unit -> signature of every unit whose rows are all committed under that signature.

    Held on the driver (one entry per unit; a folder's units are its files), like the ids
    `engine.chunked` broadcasts; the three columns are read, never the images."""
    if target.version() is None:
        return {}
    table = target.open().to_table(columns=list(UNIT_COLUMNS))
    if table.num_rows == 0:
        return {}
    groups = table.group_by(["unit", "unit_signature"]).aggregate(
        [("unit_items", "max"), ([], "count_all")])
    complete = groups.filter(pc.equal(groups["unit_items_max"], groups["count_all"]))
    return dict(zip(complete["unit"].to_pylist(), complete["unit_signature"].to_pylist(),
                    strict=True))


def schema_mismatch(target: CommitTarget) -> str | None:
    """Why an existing table cannot be updated in place (a table of an older schema), or
    None (no table, or the current schema)."""
    if target.version() is None:
        return None
    names = target.open().schema.names
    if names == RAW_IMAGES_SCHEMA.names:
        return None
    missing = [n for n in RAW_IMAGES_SCHEMA.names if n not in names]
    return (f"its schema lacks {', '.join(missing)}" if missing
            else "its columns differ from the current schema")


def reset_table(target: CommitTarget) -> int:
    """Replace the table with an empty one of the current schema (one commit); the units
    are then all pending and the run rebuilds it in full."""
    return overwrite_rows(target.table, RAW_IMAGES_SCHEMA.empty_table(), RAW_IMAGES_SCHEMA)


@dataclass
class IngestPlan:
    """What the listing found and what is left to read.

    Two ways to compare, picked by the table's size: on the driver (the listing kept as a
    dict, compared with `completed_units`), or past `DRIVER_COMPARE_ROWS` with Ray
    hash joins (the listing stays in Ray's object store, nothing per unit on the driver)."""

    location: SourceLocation
    units_listed: int = 0
    pending_units: int = 0
    blocks: list[PutTable] = field(default_factory=list)  # pa.Tables of UNIT_FIELDS
    listed: dict[str, str] | None = None  # driver comparison: unit -> signature now
    pending_rows: ray.data.Dataset | None = None  # Ray comparison: units left to read

    def pending(self) -> ray.data.Dataset | None:
        if self.listed is None:
            return self.pending_rows if self.pending_units else None
        return dataset_of(self.blocks) if self.blocks else None

    def signatures(self, units: list[str]) -> dict[str, str]:
        """unit -> signature in the listing, of those of `units` it holds."""
        if self.listed is not None:
            return {u: self.listed[u] for u in units if u in self.listed}
        wanted = pa.array(units, pa.string())
        found: dict[str, str] = {}
        for block in ray.get([b.ref for b in self.blocks]):  # only for a chunk with a rival
            block = block.filter(pc.is_in(block.column("unit"), wanted))
            found.update(zip(block.column("unit").to_pylist(),
                             block.column("unit_signature").to_pylist(), strict=True))
        return found

    def stale_ids(self, target: CommitTarget) -> list[str]:
        if self.listed is not None:
            return stale_ids(target, self.listed)
        return stale_ids_joined(target, dataset_of(self.blocks),
                                self.units_listed)


def plan_ingest(spec: SourceSpec, uri: str | Path | SourceLocation, done: dict[str, str],
                block_units: int = UNIT_BLOCK, keep_listing: bool = True) -> IngestPlan:
    """List the source and queue, in blocks, every unit whose listed signature is not
    done (with `keep_listing=False`, every unit, and no dict of them on the driver)."""
    plan = IngestPlan(readers.resolve_location(spec, uri), listed={} if keep_listing else None)
    block: list[tuple[str, str]] = []
    for unit, signature in list_source(spec, plan.location):
        plan.units_listed += 1
        if plan.listed is not None:
            plan.listed[unit] = signature
        if done.get(unit) == signature:
            continue
        block.append((unit, signature))
        if len(block) >= block_units:
            plan.blocks.append(_put_block(block))
            plan.pending_units += len(block)
            block = []
    if block:
        plan.blocks.append(_put_block(block))
        plan.pending_units += len(block)
    return plan


def plan_ingest_joined(spec: SourceSpec, uri: str | Path | SourceLocation,
                       target: CommitTarget, block_units: int = UNIT_BLOCK) -> IngestPlan:
    """The plan for a big table: the listing anti-joined with the completed units of the
    table in Ray (hash-partitioned), materialised once (unit names only)."""
    plan = plan_ingest(spec, uri, done={}, block_units=block_units, keep_listing=False)
    if not plan.blocks:
        return plan
    listed = dataset_of(plan.blocks)
    # ignore: Ray annotates `on` as Tuple[str] (one column), though a join takes several.
    pending = listed.join(completed_pairs(target), join_type="left_anti",
                          on=UNIT_KEYS,  # type: ignore[arg-type]
                          num_partitions=hash_partitions(plan.units_listed)).materialize()
    plan.pending_rows, plan.pending_units = pending, pending.count()
    return plan


def completed_pairs(target: CommitTarget) -> ray.data.Dataset:
    """(unit, unit_signature) of every complete unit of the table, computed in Ray."""
    grouped = target.table.latest().read(columns=list(UNIT_COLUMNS)) \
        .groupby(list(UNIT_KEYS)).aggregate(Count(alias_name="rows"),
                                            Max("unit_items", alias_name="expected"))
    return grouped.map_batches(_complete_only, batch_format="pyarrow")


def _complete_only(groups: pa.Table) -> pa.Table:
    complete = groups.filter(pc.fill_null(pc.equal(groups["rows"], groups["expected"]), False))
    return complete.select(list(UNIT_KEYS))


def _put_block(units: list[tuple[str, str]]) -> PutTable:
    names, signatures = zip(*units, strict=True)
    return put_table(pa.table([pa.array(names, pa.string()),
                               pa.array(signatures, pa.string())], schema=UNIT_FIELDS))


# ------------------------------------------------------------------ reading units (Ray tasks)

def expand_units(units: pa.Table, spec: SourceSpec, location: SourceLocation | str,
                 options: IngestOptions, node_column: bool = False) -> Iterator[pa.Table]:
    """Ray map_batches UDF: a batch of units -> bounded tables of raw rows, marked with the
    Ray node that read them (schema metadata, or with `node_column` a column that survives
    the runner's re-batching; the committer drops it)."""
    if not isinstance(location, SourceLocation):
        location = SourceLocation.of(location)
    signatures = (units.column("unit_signature").to_pylist()
                  if "unit_signature" in units.column_names else [None] * units.num_rows)
    for table in rows_to_tables(
        row
        for unit, signature in zip(units.column("unit").to_pylist(), signatures, strict=True)
        for row in _unit_rows(spec, location, unit, signature, options)
    ):
        yield with_node_column(table) if node_column else tag_with_node(table)
        failpoint("ingest.expand_units")


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


def _unit_rows(spec: SourceSpec, location: SourceLocation, unit: str,
               signature: str | None, options: IngestOptions) -> Iterator[dict]:
    """The unit's rows, each naming its unit and signature; the last one also says how
    many rows the unit yielded (held back one row to know which is last). A key repeated
    within the unit (a tar whose members of one sample are not adjacent) keeps its first
    item: one id is one row."""
    previous: dict | None = None
    count = 0
    seen: set[str] = set()
    for item in _items_of_unit(spec, location, unit, signature, options):
        row = raw_row(spec.name, item, options.max_pixels, options.max_caption_bytes,
                      spec.license, options.read_rights)
        if row["id"] in seen:
            continue
        seen.add(row["id"])
        row.update(unit=unit, unit_signature=signature)
        if previous is not None:
            yield previous
        previous, count = row, count + 1
    if previous is not None:
        previous["unit_items"] = count
        yield previous


def _items_of_unit(spec: SourceSpec, location: SourceLocation, unit: str,
                   signature: str | None, options: IngestOptions) -> Iterator[FoundItem]:
    if spec.kind == "image_folder":
        yield readers.read_image_file(spec, location, unit, options.max_file_bytes)
    elif spec.kind == "webdataset":
        yield from readers.read_tar(spec, location, unit, options.max_file_bytes)
    elif spec.kind == "parquet":
        yield from readers.read_parquet_file(spec, location, unit,
                                             max_file_bytes=options.max_file_bytes)
    elif spec.kind == "lance":
        yield from readers.read_lance_fragment(spec, location, unit, signature or "")
    else:
        raise ValueError(f"kind {spec.kind!r} has no units")


def read_units(units: ray.data.Dataset, spec: SourceSpec, location: SourceLocation,
               options: IngestOptions, node_column: bool = False) -> ray.data.Dataset:
    """The lazy dataset of raw rows of `units` (the Ray stage of an ingest)."""
    # Tars, parquet files and fragments are big units: one per task keeps them parallel;
    # small blocks of units let the expensive expansion spread over every node.
    per_task = options.units_per_task if spec.kind == "image_folder" else 1
    return units.repartition(target_num_rows_per_block=per_task).map_batches(
        functools.partial(expand_units, spec=spec, location=location, options=options,
                          node_column=node_column),
        batch_format="pyarrow", batch_size=per_task,
    )


def build_raw_dataset(spec: SourceSpec, uri: str | Path,
                      options: IngestOptions = IngestOptions()) -> ray.data.Dataset:
    """The lazy dataset of every `raw_images` row of the source (a full read, nothing
    compared; for benches and one-shot writes)."""
    plan = plan_ingest(spec, uri, done={})
    pending = plan.pending()
    if pending is None:
        return ray.data.from_arrow(RAW_IMAGES_SCHEMA.empty_table())
    return read_units(pending, spec, plan.location, options)


# ------------------------------------------------------------------ the incremental run

@dataclass
class IngestReport(ChunkedReport):
    """One ingest run: the runner's counts (`commits`) and the comparison's."""

    units_listed: int = 0
    units_read: int = 0
    rows: int = 0  # rows in the table after the run
    rows_removed: int = 0
    rebuilt_because: str | None = None  # set when an old-schema table was rebuilt
    version_before: int | None = None
    nodes: set[str] = field(default_factory=set)

    @property
    def rows_processed(self) -> int:
        return self.commits.rows

    @property
    def rows_reused(self) -> int:
        return max(0, self.rows - self.commits.committed)

    @property
    def changed(self) -> bool:
        return self.lance_version != self.version_before


ChunkHook = Callable[[pa.Table, ChunkedRun], None]


def ingest_source(spec: SourceSpec, uri: str | Path | SourceLocation, target: CommitTarget,
                  options: IngestOptions = IngestOptions(),
                  on_chunk: ChunkHook | None = None,
                  log: Callable[[str], None] = lambda message: None) -> IngestReport:
    """Bring the source's table up to date with the source: read what changed, commit it
    in chunks, delete what left. Safe to kill at any point and to rerun."""
    report = IngestReport(version_before=target.version())
    reason = schema_mismatch(target)
    if reason:
        log(f"{target.table}: rebuilding in full once, {reason} (change detection needs them)")
        reset_table(target)
        report.rebuilt_because = reason
    rows_before = target.open().count_rows() if target.version() is not None else 0
    plan = (plan_ingest(spec, uri, completed_units(target))
            if rows_before <= DRIVER_COMPARE_ROWS else plan_ingest_joined(spec, uri, target))
    report.units_listed, report.units_read = plan.units_listed, plan.pending_units
    log(f"{spec.name}: {report.units_listed:,} unit(s) listed, {report.units_read:,} to read")

    def committed(chunk: pa.Table, run: ChunkedRun) -> None:
        report.nodes.update(pc.unique(chunk.column(NODE_COLUMN)).to_pylist())
        failpoint("ingest.chunk_committed")
        if on_chunk:
            on_chunk(chunk, run)

    pending = plan.pending()
    rivals = CommittedRivals(target, plan.signatures)
    report.commits = run_chunked(
        pending, lambda units: read_units(units, spec, plan.location, options, node_column=True),
        target, options.chunk_rows, to_commit=lambda chunk: rows_to_commit(chunk, rivals),
        on_chunk=committed)
    report.rows_removed = delete_stale_rows(target, plan, RemovalLimit(
        options.max_removed_share, options.removal_floor_rows))
    table = target.open() if target.version() is not None else None
    if table is None:  # an empty source never written: an empty table all the same
        create_empty(target.table, RAW_IMAGES_SCHEMA)
        table = target.open()
    report.commits.lance_version = table.version
    report.rows = table.count_rows()
    return report


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

    share: float = IngestOptions.max_removed_share
    floor_rows: int = IngestOptions.removal_floor_rows

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
