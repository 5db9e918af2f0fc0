"""The image stage over a partition: raw_images rows in, bucketed rows (with phash) out,
as a Ray Data map over bounded batches. Rows rejected at ingest pass their status through,
so every raw row has exactly one bucketed row.

The stage is incremental per row: each bucketed row records what it was made from, the raw
row's `sha256` and the fingerprint of the stage's settings (`settings`). A run redoes only
the raw rows that are new, whose bytes changed, or whose bucketed row was made under other
settings (so a settings change redoes everything, and is itself resumable); ids gone from
raw_images leave both tables.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field

import lance
import pyarrow as pa
import pyarrow.compute as pc
import ray.data

from prx_assets.engine.batches import batch_fn
from prx_assets.engine.chunked import (
    BROADCAST_IDS,
    hash_partitions,
    new_if_empty,
)
from prx_assets.engine.removals import delete_ids, removed_ids
from prx_assets.engine.stage import (
    Pending,
    Stage,
    StageReport,
    TableSpec,
    run_stage,
    with_node_column,
    without_node_column,
)
from prx_assets.stages.images.imaging import ImageOptions, process_image
from prx_assets.storage.changes import (
    Changes,
    added_rows,
    changes_since,
    forget_consumed,
    read_consumed,
    rows_with_ids,
)
from prx_assets.storage.failpoints import failpoint
from prx_assets.storage.filters import sql_string
from prx_assets.storage.key_index import maintain_key_index, refresh_key_index
from prx_assets.storage.lance_tables import (
    FragmentPolicy,
    adopt_encodings,
    cleanup,
    compact,
    overwrite_rows,
    tag_with_node,
    upsert,
)
from prx_assets.storage.refs import TableRef
from prx_assets.storage.tables import image_bytes_field

# Bump when the stage's output for the same raw bytes and settings changes (a new resize,
# encoder or hash): every bucketed row then reads as stale and is redone.
STAGE_VERSION = "2"

BUCKETED_SCHEMA = pa.schema([
    pa.field("id", pa.string(), nullable=False),
    pa.field("source", pa.string(), nullable=False),
    pa.field("status", pa.string(), nullable=False),
    pa.field("tier", pa.int32()),
    pa.field("width", pa.int32()),
    pa.field("height", pa.int32()),
    pa.field("original_width", pa.int32()),
    pa.field("original_height", pa.int32()),
    image_bytes_field(),
    pa.field("error", pa.string()),
    # The hash columns ride along from the same decode; `phashes` projects them.
    pa.field("phash", pa.int64()),
    pa.field("pixels", pa.int64()),
    pa.field("flat", pa.bool_()),
    # What the row was made from: the raw row's sha256 and the stage settings' fingerprint.
    pa.field("raw_sha256", pa.string()),
    pa.field("settings", pa.string()),
])

PHASH_COLUMNS = ["id", "phash", "pixels", "flat"]
PHASH_SCHEMA = pa.schema([BUCKETED_SCHEMA.field(name) for name in PHASH_COLUMNS])
RAW_COLUMNS = ["id", "source", "status", "image", "error", "width", "height", "sha256"]
BATCH_ROWS = 8  # decoded images are large: keep each task's working set small
KEY = "_made_from"  # transient join key: id and raw sha256
UPSTREAM = "raw_images"  # what bucketed's record of the raw rows it consumed is called
# Past this many raw rows in new fragments, pending rows are found from every fresh key
# (one read of two columns) instead of looked up by id (~5 µs an id).
LOOKUP_ROWS = 100_000


def settings_fingerprint(options: ImageOptions) -> str:
    """A short digest of everything that decides a bucketed row besides its raw bytes: the
    bucket rule, quality, subsampling, resize mode, draft / reducing settings, max_pixels
    and the stage's code version."""
    spec = {"stage_version": STAGE_VERSION, **dataclasses.asdict(options)}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def bucket_batch(batch: pa.Table, options: ImageOptions, fingerprint: str = "") -> pa.Table:
    rows = []
    for raw in batch.to_pylist():
        row = {"id": raw["id"], "source": raw["source"], "status": raw["status"],
               "error": raw["error"], "original_width": raw["width"],
               "original_height": raw["height"], "raw_sha256": raw.get("sha256"),
               "settings": fingerprint}
        if raw["status"] == "ok":
            result = process_image(raw["image"], options)
            row.update(status=result.status, error=result.error, tier=result.tier,
                       width=result.width, height=result.height, image=result.image,
                       phash=result.phash, flat=result.flat)
            if result.original_width is not None:
                row.update(original_width=result.original_width,
                           original_height=result.original_height)
            if result.phash is not None:
                row["pixels"] = row["original_width"] * row["original_height"]
        rows.append(row)
    failpoint("images.bucket_batch")
    return tag_with_node(pa.Table.from_pylist(rows, schema=BUCKETED_SCHEMA))


def build_bucketed_dataset(raw: ray.data.Dataset, options: ImageOptions = ImageOptions()
                           ) -> ray.data.Dataset:
    # No repartition before the map: Ray Data already splits a read's blocks so that one
    # large fragment is many decoding tasks, and a repartition operator cost one more Ray
    # task per 5-8 rows (2,000 tasks for 10,000 images) for nothing.
    return raw.map_batches(
        functools.partial(bucket_batch, options=options,
                          fingerprint=settings_fingerprint(options)),
        batch_format="pyarrow", batch_size=BATCH_ROWS,
    )


# --- what a run has to do -----------------------------------------------------------------

def made_from_key(ids: pa.ChunkedArray | pa.Array, shas: pa.ChunkedArray | pa.Array
                  ) -> pa.ChunkedArray | pa.Array:
    """id and sha256 in one string (a raw row without bytes has no sha256: empty)."""
    return pc.binary_join_element_wise(ids, pc.fill_null(shas, ""), "\x00")


def _with_key(batch: pa.Table, sha_column: str) -> pa.Table:
    return batch.append_column(KEY, made_from_key(batch.column("id"), batch.column(sha_column)))


def _drop_keys(batch: pa.Table, keys: pa.Array) -> pa.Table:
    mask = pc.is_in(made_from_key(batch.column("id"), batch.column("sha256")), value_set=keys)
    return batch.filter(pc.invert(mask))


@dataclass(frozen=True)
class ImageTables:
    """The two tables the stage writes (their latest versions) and how big their fragments
    grow."""

    bucketed: TableRef
    phashes: TableRef
    bucketed_policy: FragmentPolicy = FragmentPolicy()
    phash_policy: FragmentPolicy = FragmentPolicy()


def fresh_rows(tables: ImageTables, fingerprint: str) -> tuple[lance.LanceDataset | None, str,
                                                                int]:
    """The bucketed table, the filter selecting its rows made under `fingerprint`, and how
    many rows match (None, "", 0 when there are none)."""
    if not tables.bucketed.exists():
        return None, "", 0
    table = tables.bucketed.latest().open()
    if "settings" not in table.schema.names:  # made before rows recorded their settings
        return None, "", 0
    where = f"settings = {sql_string(fingerprint)}"
    count = table.count_rows(filter=where)
    return (table, where, count) if count else (None, "", 0)


def pending_raw(raw: ray.data.Dataset, tables: ImageTables, fingerprint: str,
                broadcast_limit: int = BROADCAST_IDS) -> ray.data.Dataset:
    """The raw rows (with a `sha256` column) that have no bucketed row made from these very
    bytes under these settings: new, changed, or made under other settings.

    Up to `broadcast_limit` fresh rows, their (id, sha256) keys are read on the driver
    (ids and digests only, ~100 bytes a row) and broadcast to the tasks; past it, a
    hash-partitioned Ray join."""
    table, where, n_fresh = fresh_rows(tables, fingerprint)
    if table is None:
        return raw
    if n_fresh > broadcast_limit:
        keys = tables.bucketed.at(table.version).read(columns=["id", "raw_sha256"],
                                                      filter=where) \
            .map_batches(batch_fn(_with_key), fn_kwargs={"sha_column": "raw_sha256"},
                         batch_format="pyarrow").select_columns([KEY])
        return raw.map_batches(batch_fn(_with_key), fn_kwargs={"sha_column": "sha256"},
                               batch_format="pyarrow") \
            .join(keys, join_type="left_anti", on=(KEY,),
                  num_partitions=hash_partitions(n_fresh)).drop_columns([KEY])
    fresh = table.to_table(columns=["id", "raw_sha256"], filter=where)
    keys = made_from_key(fresh.column("id"), fresh.column("raw_sha256")).combine_chunks()
    return raw.map_batches(batch_fn(_drop_keys), fn_kwargs={"keys": keys}, batch_format="pyarrow",
                           zero_copy_batch=True)


def raw_changes(raw_table: TableRef, tables: ImageTables, fingerprint: str) -> Changes | None:
    """What changed in raw_images (the pinned version) since bucketed last consumed all of
    it under these settings; None without such a record (compare in full)."""
    since = read_consumed(tables.bucketed, UPSTREAM, tag=fingerprint)
    return changes_since(raw_table.open(), since) if since is not None else None


def pending_changed_raw(raw_table: TableRef, changes: Changes, tables: ImageTables,
                        fingerprint: str) -> ray.data.Dataset:
    """`pending_raw` over only the raw rows in fragments written since the record: a +1
    file run on a 10⁸-row source reads the new file's rows and looks their ids up in
    bucketed, instead of reading both tables' keys whole."""
    raw = raw_table.read(columns=RAW_COLUMNS, filter=changes.added_filter)
    if changes.added_rows > LOOKUP_ROWS:
        return pending_raw(raw, tables, fingerprint)
    offered = raw_table.to_table(columns=["id"], filter=changes.added_filter).column("id")
    done = rows_with_ids(tables.bucketed.latest().open(), offered.combine_chunks(),
                         ["id", "raw_sha256"], where=f"settings = {sql_string(fingerprint)}")
    keys = made_from_key(done.column("id"), done.column("raw_sha256")).combine_chunks()
    return raw.map_batches(batch_fn(_drop_keys), fn_kwargs={"keys": keys}, batch_format="pyarrow",
                           zero_copy_batch=True)


def ensure_table(target: TableRef, schema: pa.Schema, replace: bool = False) -> bool:
    """An empty table where none is yet, so downstream can read a source with no rows;
    a table lacking columns of `schema` (a bucketed table from before rows recorded what
    they were made from: every row would be redone anyway), or any with `replace`, is
    replaced by an empty one. Returns whether it replaced a table."""
    existed = target.exists()
    if existed and not replace and set(schema.names) <= set(target.latest().open().schema.names):
        adopt_encodings(target, schema)
        return False
    forget_consumed(target)  # first: a kill between the two must not leave a record
    overwrite_rows(target, schema.empty_table(), schema)
    return existed


# --- one run ------------------------------------------------------------------------------

@dataclass
class ImageRunReport(StageReport):
    """What one run of the stage did to its two tables (`commits` counts bucketed chunks;
    `removed`, bucketed rows deleted because their ids left raw_images)."""

    hashes_written: int = 0  # phashes rows upserted
    hashes_removed: int = 0  # phashes rows deleted: id removed, or its new row has no hash
    hashes_compacted_from: int | None = None
    nodes: set[str] = field(default_factory=set)  # Ray nodes whose tasks produced the rows


def remove_ids(tables: ImageTables, report: ImageRunReport, gone: pa.Array) -> None:
    """Delete the rows of ids that left raw_images, phashes first (see `ImageStage`)."""
    report.hashes_removed += delete_ids(tables.phashes, gone)
    report.removed += delete_ids(tables.bucketed, gone)


def images_to_process(raw: TableRef, tables: ImageTables, fingerprint: str) -> int:
    """The progress total: the raw rows written since bucketed's record of what it consumed
    (fragment counts, no scan); without a record, raw rows less the bucketed rows already
    made under these settings (an estimate when raw rows changed or left: the line's total
    grows if the stage does more)."""
    since = read_consumed(tables.bucketed, UPSTREAM, tag=fingerprint)
    if since is not None:
        return added_rows(raw.open().get_fragments(), since)
    _, _, fresh = fresh_rows(tables, fingerprint)
    return max(0, raw.count_rows() - fresh)


class ImageStage(Stage[ImageRunReport]):
    """raw_images rows in, bucketed rows (with phash) out, and phashes beside them.

    Ordering, so that a kill anywhere is repaired by the rerun and readers never see an
    id twice: every commit is keyed on id (a merge-insert or a delete), and phashes is
    written *before* bucketed, for deletions and for each chunk. What the rerun looks at
    is bucketed: a row missing or stale there is redone, and its phashes row rewritten with
    the same values (the stage is deterministic), so phashes can be ahead of bucketed for
    at most one chunk, never behind it. (Syncing phashes from bucketed at the end would
    need a full comparison of the two tables on every run to find what a kill left out.)
    """

    upstream = UPSTREAM
    failpoint = "images.chunk_committed"

    def __init__(self, raw: ray.data.Dataset, tables: ImageTables, options: ImageOptions):
        self.raw, self.tables, self.options = raw, tables, options
        self.fingerprint = settings_fingerprint(options)
        self.table = TableSpec(BUCKETED_SCHEMA, ("id",), tables.bucketed_policy)
        self.changes: Changes | None = None
        self.current = ImageRunReport()

    def report(self) -> ImageRunReport:
        self.current = ImageRunReport()
        return self.current

    def record_tag(self) -> str:
        return self.fingerprint

    def ensure(self, target: TableRef) -> None:
        # A replaced bucketed table can no longer say which ids left: phashes starts over.
        replaced = ensure_table(target, BUCKETED_SCHEMA)
        ensure_table(self.tables.phashes, PHASH_SCHEMA, replace=replaced)

    def pending(self, upstream: TableRef, target: TableRef, report: ImageRunReport) -> Pending:
        """With a record, the removed ids and the pending rows come from raw's changes since
        (`raw_changes`); without one, from comparing both tables."""
        self.changes = changes = raw_changes(upstream, self.tables, self.fingerprint)
        if changes is None or changes.removed is not None:
            remove_ids(self.tables, report, removed_ids(target, upstream)
                       if changes is None else changes.removed)
        # A first run (bucketed empty) appends: raw_images holds each id once.
        new_rows = new_if_empty(target)
        rows = pending_raw(self.raw, self.tables, self.fingerprint) if changes is None \
            else pending_changed_raw(upstream, changes, self.tables, self.fingerprint)
        return Pending(images_to_process(upstream, self.tables, self.fingerprint), rows,
                       new_rows=new_rows)

    def transform(self, rows: ray.data.Dataset, count: int) -> ray.data.Dataset:
        return build_bucketed_dataset(rows, self.options).map_batches(
            with_node_column, batch_format="pyarrow", zero_copy_batch=True)

    def to_commit(self, chunk: pa.Table) -> pa.Table:
        """phashes first: its rows of the chunk upserted (deleted for rows without a hash);
        bucketed then commits the whole chunk."""
        report, phashes = self.current, self.tables.phashes
        chunk = without_node_column(chunk, report.nodes)
        hashed = chunk.filter(pc.is_valid(chunk.column("phash")))
        unhashed = chunk.filter(pc.is_null(chunk.column("phash"))).column("id")
        report.hashes_removed += delete_ids(phashes, unhashed.combine_chunks())
        if hashed.num_rows:
            upsert(phashes, hashed.select(PHASH_COLUMNS), PHASH_SCHEMA, ["id"])
            maintain_key_index(phashes, "id", self.tables.phash_policy.key_index)
            report.hashes_written += hashed.num_rows
        return chunk

    def after(self, upstream: TableRef, target: TableRef, report: ImageRunReport) -> None:
        """phashes' index, compaction and cleanup, as the runner does bucketed's; after a raw
        compaction, the ids that left (unknown from the changes) once more bucketed rows
        than raw rows say some did. Every raw row of this version now has its bucketed row:
        the record that follows hands the next run only what changes after it."""
        phashes, policy = self.tables.phashes, self.tables.phash_policy
        if report.commits.commits:
            refresh_key_index(phashes, "id", policy.key_index)
        if report.commits.commits > 1:
            report.hashes_compacted_from = compact(phashes, policy)
            cleanup(phashes.latest().open(), policy)
        if self.changes is not None and self.changes.removed is None \
                and target.latest().count_rows() > upstream.count_rows():
            remove_ids(self.tables, report, removed_ids(target, upstream))


def run_image_stage(raw: ray.data.Dataset, raw_table: TableRef, tables: ImageTables,
                    options: ImageOptions, chunk_rows: int,
                    on_chunk: Callable[[ImageRunReport], None] | None = None) -> ImageRunReport:
    """Bring both tables up to date with `raw` (rows with RAW_COLUMNS read from `raw_table`,
    the pinned raw_images version): delete removed ids, then decode what is pending and
    commit it in chunks of `chunk_rows`, then record what was consumed (`ImageStage`)."""
    return run_stage(ImageStage(raw, tables, options), raw_table, tables.bucketed, chunk_rows,
                     on_chunk)
