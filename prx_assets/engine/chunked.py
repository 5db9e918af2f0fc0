"""Incremental, resumable work on one Lance table, committed chunk by chunk.

A per-source stage that takes hours (captioning a source on GPUs, labelling its captions)
must not lose its work when it is killed, and must not redo or double what it already
wrote. The pattern, shared by every such stage:

1. **select pending rows**: the input rows whose key is not yet committed in the target
   (`pending_rows`, or `without_ids` / `drop_ids` when the stage knows its done ids);
2. **run a Ray stage** over them, lazily, results streaming back to the driver;
3. **merge-insert** the results into the target in chunks of `chunk_rows`, keyed on the
   target's keys: each chunk is one atomic Lance commit, so a run killed after chunk k has
   committed exactly k chunks, a rerun selects only the rest, and a retried row replaces
   its earlier row instead of doubling it (keys stay unique at every table version).
   Rows the stage knows are new (`NewRows`: selected absent at a version it names) are
   **appended** instead, with no lookup at all, for as long as no other writer commits
   in between (`lance_tables.append_new`); a merge-insert looks its keys up through the
   target's key index on its first key column (`storage.key_index`), which the run keeps
   up to date after each commit, so a chunk's cost grows with the chunk, not with the
   table (a target keyed on several columns looks its rows up itself, appends those
   absent and merges the rest: `upsert_looked_up`);
4. merge the key index, **compact** the small fragments the chunks left once they are more
   than a healthy table holds (`lance_tables.needs_compaction`; the index is remapped onto
   them) and **clean up** old versions;
5. **report** what was done (`ChunkedRun`), with a callback after each commit for progress
   and for the stage's own counts.

Nothing here knows Dagster or a stage's schema: a stage passes its target (`CommitTarget`)
and its Ray stage, and keeps its own report.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import overload

import lance
import pyarrow as pa
import ray.data

from prx_assets.engine.batches import arrow_batches, batch_fn
from prx_assets.engine.id_sets import IdSet
from prx_assets.storage.changes import Changes, present_ids
from prx_assets.storage.key_index import indexable_key, maintain_key_index, refresh_key_index
from prx_assets.storage.keyed_writes import split_present
from prx_assets.storage.lance_tables import (
    FragmentPolicy,
    append_new,
    cleanup,
    compact,
    needs_compaction,
    upsert,
)
from prx_assets.storage.refs import TableRef

# `drop_ids` caps its tasks at the CPUs; Ray Data warns whenever a map gets fewer blocks
# than its cap (every small run), though the cap is only an upper bound.
warnings.filterwarnings("ignore", category=UserWarning,
                        message="The maximum number of concurrent tasks for 'MapBatches")
# Below this many ids, set membership is broadcast to every task (no shuffle); above it, a
# hash-partitioned Ray join keeps memory bounded per node.
BROADCAST_IDS = 1_000_000
ID = "id"
# A chunked writer's Lance caches: the key index's pages its lookups touch, and manifests.
WRITER_INDEX_CACHE_BYTES = 256 << 20
WRITER_METADATA_CACHE_BYTES = 64 << 20


@dataclass(frozen=True)
class CommitTarget:
    """The Lance table a chunked run writes: where, its schema, the columns that identify a
    row (a merge-insert on them replaces, never doubles) and how big its fragments get."""

    table: TableRef
    schema: pa.Schema
    keys: Sequence[str]
    fragments: FragmentPolicy = FragmentPolicy()

    def open(self) -> lance.LanceDataset:
        return self.table.latest().open()

    def version(self) -> int | None:
        """The table's latest version, None while it does not exist."""
        return self.table.latest_version()


@dataclass(frozen=True)
class NewRows:
    """The rows a stage yields have distinct keys, none of them in the target at `version`
    (None: the target did not exist): they can be appended without a lookup."""

    version: int | None


@dataclass(frozen=True)
class AbsentRows:
    """A chunk's rows to commit whose keys the stage looked up itself (`to_commit`): none
    was in the target at `version`, so they are appended without a merge's lookup (ingest:
    every chunk of a new source, every new file of a known one)."""

    rows: pa.Table
    version: int


@dataclass
class ChunkedRun:
    """What one chunked run did; updated after every commit, so a callback sees it grow."""

    chunks: int = 0  # chunks the stage yielded (a chunk with nothing to commit counts too)
    commits: int = 0  # merge-inserts committed
    rows: int = 0  # rows the stage yielded
    committed: int = 0  # rows committed (appended or merge-inserted)
    appended: int = 0  # of those, rows appended without a key lookup
    index_updates: int = 0  # key index created, given a delta segment or merged
    seconds: float = 0.0
    lance_version: int | None = None  # the target's version after the run (or the commit)
    compacted_from: int | None = None  # fragments before compaction; None: not compacted

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0


@dataclass
class ChunkedReport:
    """Base of a stage's run report: the runner's counts (`commits`, replaced after each
    chunk) read through, beside whatever the stage counts itself."""

    commits: ChunkedRun = field(default_factory=ChunkedRun, kw_only=True)

    @property
    def written(self) -> int:
        """Rows committed."""
        return self.commits.committed

    @property
    def chunks(self) -> int:
        return self.commits.chunks

    @property
    def seconds(self) -> float:
        return self.commits.seconds

    @property
    def lance_version(self) -> int | None:
        return self.commits.lance_version


ChunkCallback = Callable[[pa.Table, ChunkedRun], None]


def run_chunked(pending: ray.data.Dataset | None,
                stage: Callable[[ray.data.Dataset], ray.data.Dataset],
                target: CommitTarget, chunk_rows: int, *,
                to_commit: Callable[[pa.Table], pa.Table | AbsentRows] | None = None,
                on_chunk: ChunkCallback | None = None,
                new_rows: NewRows | None = None) -> ChunkedRun:
    """Run `stage` over `pending` and commit its output to `target` chunk by chunk.

    `pending=None` means nothing to do: the stage is not even built (no actor pool starts,
    no model loads). `to_commit` picks the rows of a chunk to write (default: all), e.g. to
    leave failed rows out so the next run retries them; rows it returns as `AbsentRows` are
    appended (no merge) while the target is still at the version they were absent from.
    `on_chunk(chunk, run)` runs after each chunk is committed; whatever it raises stops the
    run with the commits so far kept.
    `new_rows` says the stage's rows are new as of a target version: they are appended
    while no other writer commits (then merged). After each commit the key index is kept
    up to date; after the last chunk, a run of more than one commit merges the target's key
    index, compacts it if it holds more fragments than a healthy table, and cleans up its
    old versions.
    """
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be at least 1, not {chunk_rows}")
    if pending is None:
        return ChunkedRun(lance_version=target.version())
    return commit_chunks(arrow_batches(stage(pending), batch_size=chunk_rows), target,
                         to_commit=to_commit, on_chunk=on_chunk, new_rows=new_rows)


def commit_chunks(chunks: Iterable[pa.Table], target: CommitTarget, *,
                  to_commit: Callable[[pa.Table], pa.Table | AbsentRows] | None = None,
                  on_chunk: ChunkCallback | None = None,
                  new_rows: NewRows | None = None) -> ChunkedRun:
    """`run_chunked`'s commits: each of `chunks` committed to `target` as it comes, then the
    key index refreshed, the fragments compacted and old versions cleaned up. Public for
    what commits chunks it made without Ray (`bench.rights`: an ingest's write path)."""
    run = ChunkedRun(lance_version=target.version())
    started = time.perf_counter()
    writer = _ChunkWriter(target, new_rows)
    for chunk in chunks:
        picked = to_commit(chunk) if to_commit else chunk
        absent_at = picked.version if isinstance(picked, AbsentRows) else None
        rows = picked.rows if isinstance(picked, AbsentRows) else picked
        if rows.num_rows:
            run.lance_version = writer.commit(rows, run, absent_at)
            run.commits += 1
        run.chunks += 1
        run.rows += chunk.num_rows
        run.committed += rows.num_rows
        run.seconds = time.perf_counter() - started
        if on_chunk:
            on_chunk(chunk, run)
    # The index first: Lance does not compact fragments an index covers with ones it does
    # not (or ones different segments cover) into one.
    if run.commits and writer.key and refresh_key_index(target.table, writer.key,
                                                        target.fragments.key_index,
                                                        writer.session):
        run.index_updates += 1
    if run.commits > 1:
        if needs_compaction(target.table, target.fragments, writer.session):
            run.compacted_from = compact(target.table, target.fragments)
        cleanup(target.open(), target.fragments)
    run.lance_version = target.version()
    run.seconds = time.perf_counter() - started
    return run


class _ChunkWriter:
    """Commits a run's chunks: appends while the rows are known new and no other writer
    has committed since, merge-inserts otherwise; keeps the key index up to date."""

    def __init__(self, target: CommitTarget, new_rows: NewRows | None):
        self.target = target
        self.key = indexable_key(list(target.keys))
        self.appending = new_rows is not None and self.key is not None
        self.known_at = new_rows.version if new_rows else None
        # Lance's caches, kept across the run's opens of the target (see `upsert`), and
        # bounded: the driver's memory must not grow with the table's index or versions.
        self.session = lance.Session(index_cache_size_bytes=WRITER_INDEX_CACHE_BYTES,
                                     metadata_cache_size_bytes=WRITER_METADATA_CACHE_BYTES)

    def commit(self, rows: pa.Table, run: ChunkedRun, absent_at: int | None = None) -> int:
        """Commit one chunk; `absent_at`: a version at which none of its keys was in the
        target (the stage looked them up), so it is appended like known-new rows."""
        target = self.target
        if self.appending and self.key is not None:
            version, clean = append_new(target.table, rows, target.schema,
                                        list(target.keys), self.known_at, self.session)
            run.appended += rows.num_rows if clean else 0
            # Each clean append came straight after the last: the next chunk's rows are
            # still absent. After another writer's commit, merge.
            self.appending, self.known_at = clean, version
        elif absent_at is not None and absent_at == target.version():
            # A writer that committed since the lookup may hold some of these keys:
            # `append_new` then finds and drops the copies, as for known-new rows.
            version, clean = append_new(target.table, rows, target.schema,
                                        list(target.keys), absent_at, self.session)
            run.appended += rows.num_rows if clean else 0
        else:
            version = upsert_looked_up(target.table, rows, target.schema, list(target.keys),
                                       self.session)
        action = self.key and maintain_key_index(target.table, self.key,
                                                 target.fragments.key_index, self.session)
        if not action:
            return version
        run.index_updates += 1
        if action != "created":
            # The fragments the new segment covers, compacted into one: the fragments, and
            # so each commit's manifest, stay few.
            compact(target.table, target.fragments, self.session)
        latest = target.table.latest_version() or version
        if self.appending:
            # Index updates and compaction add no rows: the same count means no other
            # writer added any since this chunk's commit, so the next rows are still new.
            self.appending = (target.table.at(latest).count_rows()
                              == target.table.at(version).count_rows())
            self.known_at = latest
        return latest


def upsert_looked_up(table: TableRef, rows: pa.Table, schema: pa.Schema, keys: list[str],
                     session: lance.Session | None = None) -> int:
    """`upsert` for a target keyed on several columns, whose merge-insert Lance joins
    against every row of the table (at 10⁷ captions, seconds a chunk): the chunk's keys
    are looked up through the first key's index instead; rows absent are appended (checked
    for copies if another writer committed in between, `append_new`), and only rows the
    table holds (a failure retried, a replaced item) are merge-inserted. One key: Lance's
    merge-insert looks it up through the index itself."""
    if len(keys) == 1 or not table.exists():
        return upsert(table, rows, schema, keys, session)
    version = table.latest_version()
    assert version is not None  # it exists
    present, absent = split_present(table.at(version).open(session), rows, keys)
    if absent.num_rows:
        version, _ = append_new(table, absent, schema, keys, version, session)
    if present.num_rows:
        version = upsert(table, present, schema, keys, session)
    return version


# --- selecting pending rows ---------------------------------------------------------------

def pending_new_rows(rows: ray.data.Dataset, target: TableRef
                     ) -> tuple[ray.data.Dataset, NewRows]:
    """`rows` whose id is not in the target at its latest version now, and that version
    (`run_chunked(new_rows=...)` appends them). `rows` must hold each id once."""
    version = target.latest_version()
    pinned = target.at(version) if version is not None else target
    return pending_rows(rows, pinned), NewRows(version)


def pending_changed_rows(upstream: TableRef, changes: Changes, target: TableRef,
                         columns: list[str] | None = None
                         ) -> tuple[ray.data.Dataset, NewRows]:
    """Like `pending_new_rows`, over only the rows `upstream` (pinned) wrote since the
    target's record of it (`changes`): their ids are looked up in the target (~5 µs an
    id through its key index) instead of every id of both being compared."""
    version = target.latest_version()
    rows = upstream.read(columns=columns, filter=changes.added_filter)
    if version is None:
        return rows, NewRows(None)
    offered = upstream.to_table(columns=[ID], filter=changes.added_filter).column(ID)
    return drop_ids(rows, present_ids(target.at(version).open(), offered.combine_chunks())), \
        NewRows(version)


def new_if_empty(target: TableRef) -> NewRows | None:
    """Every row a stage yields is new while its target holds none (its first run): the
    target's version then (None: absent), else None (rows may exist: merge)."""
    version = target.latest_version()
    if version is None:
        return NewRows(None)
    return NewRows(version) if target.at(version).count_rows() == 0 else None


def pending_rows(rows: ray.data.Dataset, target: TableRef, done_filter: str | None = None,
                 broadcast_limit: int = BROADCAST_IDS) -> ray.data.Dataset:
    """`rows` whose id is not committed in the target yet (among the target's rows matching
    `done_filter`, e.g. one version's finished rows).

    Up to `broadcast_limit` done ids are read by one Lance scan of the `id` column on the
    driver (0.06 s for 10⁶ ids) and broadcast as an `IdSet`; a Ray Data pass to collect
    them cost a second pipeline's start on every run. Past it, a hash join."""
    if not target.exists():
        return rows
    target = target.pinned()  # the count and the ids read are of one version
    n_done = target.count_rows(filter=done_filter)
    if n_done == 0:
        return rows
    if n_done > broadcast_limit:
        return without_ids(rows, target.read(columns=[ID], filter=done_filter), n_done,
                           broadcast_limit)
    done = target.to_table(columns=[ID], filter=done_filter).column(ID)
    return drop_ids(rows, IdSet.of(done))


@overload
def collect_ids(ids: ray.data.Dataset, limit: None = None) -> pa.Array: ...


@overload
def collect_ids(ids: ray.data.Dataset, limit: int) -> pa.Array | None: ...


def collect_ids(ids: ray.data.Dataset, limit: int | None = None) -> pa.Array | None:
    """The `id` column as one array, or None once there are more than `limit` (then join
    instead of broadcasting)."""
    chunks, n = [], 0
    for batch in arrow_batches(ids, batch_size=65536):
        # A Ray join's output may hold the ids as large_string.
        chunks.append(batch.column(ID).cast(pa.string()))
        n += batch.num_rows
        if limit is not None and n > limit:
            return None
    return pa.chunked_array(chunks, pa.string()).combine_chunks() if chunks \
        else pa.array([], pa.string())


def keep_ids(batch: pa.Table, ids: IdSet, member: bool) -> pa.Table:
    """The rows of `batch` whose id is (member=True) or is not (member=False) in `ids`."""
    found = ids.contains(batch.column(ID))
    return batch.filter(pa.array(found if member else ~found, pa.bool_()))


def drop_ids(rows: ray.data.Dataset, ids: IdSet | pa.Array) -> ray.data.Dataset:
    """`rows` without the ids in `ids` (a set the driver holds, broadcast to the tasks).

    The filter asks for no CPU: it feeds a stage (a model's actor pool) that holds the
    node's CPUs, and charged one it waited for a free slot while the actors idled (labels
    on a 2-CPU node: both actors idle 45 % of the time, never both busy). Its tasks are
    capped at the cluster's CPUs all the same: uncharged, Ray started a worker process per
    block at once (8-10 on 2 cores, each importing the stack before its first block).

    The set is sorted once (`IdSet`); each block costs O(b log N), where hashing the set
    per block cost O(N) (a +0.1 % rerun at 10⁶ rows: most of its time)."""
    if len(ids) == 0:
        return rows
    id_set = ids if isinstance(ids, IdSet) else IdSet.of(ids)
    return rows.map_batches(batch_fn(keep_ids), fn_kwargs={"ids": id_set, "member": False},
                            batch_format="pyarrow", batch_size=None, zero_copy_batch=True,
                            num_cpus=0, compute=ray.data.TaskPoolStrategy(size=cpu_slots()))


def cpu_slots() -> int | None:
    """The cluster's CPUs (at least 1), a cap on tasks that ask for none; None (no cap)
    before Ray is started."""
    if not ray.is_initialized():
        return None
    return max(1, int(ray.cluster_resources().get("CPU", 1)))


def without_ids(rows: ray.data.Dataset, ids: ray.data.Dataset, n_ids: int,
                broadcast_limit: int = BROADCAST_IDS) -> ray.data.Dataset:
    """Anti-join on id: broadcast for up to `broadcast_limit` ids, a hash-partitioned join
    past that."""
    if n_ids > broadcast_limit:
        return rows.join(ids, join_type="left_anti", on=(ID,),
                         num_partitions=hash_partitions(n_ids))
    return drop_ids(rows, collect_ids(ids))


def hash_partitions(rows: int) -> int:
    """Partitions for a Ray hash join over `rows` rows: ~500k rows each, 1 to 512 (each
    partition up to the CPUs costs an aggregator actor's start)."""
    return max(1, min(512, rows // 500_000))
