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
run before anything is written (`listing.ListingError`), and a run that would delete more
than `IngestOptions.max_removed_share` of the table stops before its delete
(`removals.RemovalLimitError`).
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

from prx_assets.engine.batches import PutTable, dataset_of, put_table
from prx_assets.engine.chunked import (
    BROADCAST_IDS,
    ChunkedReport,
    ChunkedRun,
    CommitTarget,
    hash_partitions,
    run_chunked,
)
from prx_assets.engine.stage import NODE_COLUMN, with_node_column
from prx_assets.stages.ingest import readers
from prx_assets.stages.ingest.duplicate_keys import CommittedRivals, rows_to_commit
from prx_assets.stages.ingest.listing import list_source, resolve_location
from prx_assets.stages.ingest.location import SourceLocation
from prx_assets.stages.ingest.probe import DEFAULT_MAX_PIXELS
from prx_assets.stages.ingest.raw_rows import (
    DEFAULT_MAX_CAPTION_BYTES,
    RAW_IMAGES_SCHEMA,
    UNIT_COLUMNS,
    UNIT_KEYS,
    FoundItem,
    raw_row,
    rows_to_tables,
)
from prx_assets.stages.ingest.removals import (
    MAX_REMOVED_SHARE,
    REMOVAL_FLOOR_ROWS,
    RemovalLimit,
    delete_stale_rows,
    stale_ids,
    stale_ids_joined,
)
from prx_assets.stages.ingest.sources import SourceSpec
from prx_assets.storage.failpoints import failpoint
from prx_assets.storage.lance_tables import (
    adopt_encodings,
    create_empty,
    overwrite_rows,
    tag_with_node,
)

# Units per in-memory block handed to Ray (a block is a few hundred KB of paths).
UNIT_BLOCK = 10_000
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
    # A run that would delete more than this share of the table's rows stops instead,
    # unless it deletes at most the floor's rows (`removals`).
    max_removed_share: float = MAX_REMOVED_SHARE
    removal_floor_rows: int = REMOVAL_FLOOR_ROWS
    # Read the training reservations (stages/ingest/rights.py); off only for the bench's
    # baseline: rows then say "none" whatever the images carry.
    read_rights: bool = True


# ------------------------------------------------------------------ listing and comparing

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
    plan = IngestPlan(resolve_location(spec, uri), listed={} if keep_listing else None)
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
        # The reservations are read a table's block at a time (`rows_to_tables`).
        row = raw_row(spec.name, item, options.max_pixels, options.max_caption_bytes,
                      spec.license, options.read_rights, defer_rights=True)
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
    elif target.version() is not None:
        adopt_encodings(target.table, RAW_IMAGES_SCHEMA)
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
