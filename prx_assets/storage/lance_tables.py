"""Lance tables written from Ray Datasets with one atomic commit, plus fragment hygiene.

Ray tasks write data files in parallel; nothing is visible until the driver commits one
`Overwrite` with every fragment. A run killed before that commit leaves the previous
version as the latest (its orphan files are removed by `cleanup_old_versions` later), and
a rerun replaces the whole table, so it can never hold duplicate rows. The commit names the
version the write started from: a write that another writer's commit overtook fails with
`CommitConflictError` instead of replacing that commit unseen.

Every function takes the table as a `TableRef` (see `refs.py`): its URI, the version it
names where that matters, and the object-store settings resolved once, on the driver, which
go with every Lance call and into the Ray tasks that write fragments.
"""

from __future__ import annotations

import logging
import math
import pickle
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, TypedDict

import lance
import pyarrow as pa
import ray
from lance.fragment import write_fragments
from ray.data.block import Block, BlockAccessor
from ray.data.datasource.datasink import Datasink, WriteResult

from prx_assets.storage.failpoints import failpoint
from prx_assets.storage.key_index import KeyIndexPolicy
from prx_assets.storage.keyed_writes import drop_later_copies
from prx_assets.storage.reads import data_bytes
from prx_assets.storage.refs import Location, TableRef
from prx_assets.storage.retention import drop_superseded

log = logging.getLogger(__name__)

# Image-blob tables: ~512 MB fragments (a 1M-row fragment of images: hundreds of GB);
# metadata-only tables: ~1M rows per fragment (docs/architecture.md, fragment hygiene).
DEFAULT_BLOB_FRAGMENT_BYTES, DEFAULT_METADATA_FRAGMENT_ROWS = 512 << 20, 1 << 20
NODE_TAG = b"prx.ray_node"
# How often an upsert redoes its merge after losing the commit to a concurrent writer.
UPSERT_ATTEMPTS = 5


@dataclass(frozen=True)
class FragmentPolicy:
    """How big fragments should be; `target_bytes` wins for tables holding blobs."""

    target_bytes: int = DEFAULT_BLOB_FRAGMENT_BYTES
    max_rows: int = DEFAULT_METADATA_FRAGMENT_ROWS
    keep_versions: timedelta = timedelta(days=7)
    key_index: KeyIndexPolicy = KeyIndexPolicy()
    # None: versions live `keep_versions`; else a version is freed once it has been
    # superseded this long (blob tables: `retention.blob_grace()`).
    superseded_grace: timedelta | None = None


@dataclass
class WriteReport:
    uri: str
    version: int
    rows: int
    fragments: int
    bytes: int
    nodes: list[str] = field(default_factory=list)
    compacted_from: int = 0


class OutputPathError(OSError):
    """An output location that cannot be written: a file sits where a folder must be."""


class CommitConflictError(RuntimeError):
    """A write lost its commit to concurrent writers (an upsert: every time it tried; a whole
    table rewrite: once, since it would replace what the other wrote); nothing of it was
    committed, the table holds the other writers' rows, and a rerun redoes exactly it."""


def prepare_output_dir(target: TableRef | Location, what: str) -> None:
    """Make sure the folder `target` can be created or written, else fail naming the path
    and the cause (a write into it would otherwise fail deep inside a Ray task or Lance with
    an error that names neither). Creates its parent. On an object store there are no
    folders to make: the bucket, the credentials and the endpoint are checked instead."""
    if not target.is_local:
        target.check_reachable()
        return
    path = Path(target.uri)
    for part in (path, *path.parents):
        if not part.exists():
            continue
        if not part.is_dir():
            raise OutputPathError(f"cannot write {what} {path}: {part} is a file, not a folder")
        break
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputPathError(f"cannot write {what} {path}: creating {path.parent} failed: "
                              f"{exc.strerror or exc}") from exc


def create_empty(table: TableRef, schema: pa.Schema) -> int:
    """The table's version, creating it empty first if it was never written (so downstream
    readers and checks always find one); a concurrent creator's table is kept, not replaced."""
    latest = table.latest_version()
    if latest is not None:
        return latest
    prepare_output_dir(table, "Lance table")
    created = _create_if_absent(table, schema.empty_table(), schema)
    return created if created is not None else table.open().version


def add_missing_columns(table: TableRef, schema: pa.Schema) -> list[str]:
    """Give an existing table the nullable columns `schema` has and it lacks (all null: a
    metadata-only commit, no data rewritten), so a stage whose schema grew a column writes to
    a table made before it. Returns the columns added."""
    have = set(table.open().schema.names)
    missing = [f for f in schema if f.name not in have]
    required = [f.name for f in missing if not f.nullable]
    if required:
        raise ValueError(f"{table}: lacks the non-null columns {required}; only nullable "
                         "columns are added to an existing table")
    if missing:
        table.open().add_columns(pa.schema(missing))
    return [f.name for f in missing]


ENCODING_HINT = b"lance-encoding:"  # the prefix of Lance's per-field encoding metadata


def adopt_encodings(table: TableRef, schema: pa.Schema) -> list[str]:
    """Give an existing table's columns the Lance encoding hints `schema`'s fields carry
    and the table's lack (a metadata-only commit, which concurrent writers rebase over):
    Lance encodes by the table's own field metadata, so rows written to a table made
    before a hint (e.g. `tables.image_bytes_field`: image bytes uncompressed) would keep
    the old encoding; from this commit on, new fragments and compactions use the new
    one. Returns the columns changed."""
    current = table.open().schema
    updates = {}
    for wanted in schema:
        hints = {k: v for k, v in (wanted.metadata or {}).items() if k.startswith(ENCODING_HINT)}
        if not hints or wanted.name not in current.names:
            continue
        have = current.field(wanted.name).metadata or {}
        if any(have.get(k) != v for k, v in hints.items()):
            updates[wanted.name] = {k.decode(): v.decode() for k, v in hints.items()}
    if updates:
        table.open().update_field_metadata(updates)
    return sorted(updates)


class LanceOverwriteSink(Datasink[dict]):
    """Writes fragments from Ray tasks, then commits them as one Overwrite on the driver."""

    def __init__(self, table: TableRef, policy: FragmentPolicy, schema: pa.Schema | None = None,
                 read_version: int | None = None):
        self.table = table
        # The version this write replaces (None: the table did not exist when it started).
        # Its commit fails if another writer committed since, rather than replacing that
        # writer's version unseen.
        self.read_version = read_version
        self.policy = policy
        self.schema = schema
        self.nodes: list[str] = []  # Ray nodes that produced the written blocks

    def get_name(self) -> str:
        return "LanceOverwrite"

    @property
    def min_bytes_per_write(self) -> None:
        # No bundling: each block is written as it comes, and `compact` merges the fragments
        # toward the target afterwards. Bundling blocks up to a fragment per write task kept
        # the stage's outputs queued before the write, and Ray Data's downstream-capacity
        # backpressure then ran the stage feeding it one task at a time (the corpus
        # thumbnails of 2,000 images: one CPU of two idle, 18.4 s; without, 13.8 s).
        return None

    def write(self, blocks: Iterable[Block], ctx: Any) -> dict:
        nodes = {ray.get_runtime_context().get_node_id()}
        batches = _record_batches(blocks, nodes)
        first = next(batches, None)
        if first is None:
            return {"fragments": [], "schema": None, "nodes": nodes}
        schema = self.schema or first.schema
        reader = pa.RecordBatchReader.from_batches(schema, _chain_first(first, batches, schema))
        fragments = write_task_fragments(self.table, reader, schema, self.policy)
        return {"fragments": [pickle.dumps(f) for f in fragments],
                "schema": pickle.dumps(schema), "nodes": nodes}

    def on_write_complete(self, write_result: WriteResult[dict]) -> None:
        returns = list(write_result.write_returns)
        fragments = [pickle.loads(f) for r in returns for f in r["fragments"]]
        schemas = [pickle.loads(r["schema"]) for r in returns if r["schema"] is not None]
        schema = self.schema or (pa.unify_schemas(schemas) if schemas
                                 else _existing_schema(self.table))
        if schema is None:
            raise ValueError(f"{self.table}: nothing was written and no schema is known")
        commit_fragments(self.table, fragments, schema, self.read_version)
        self.nodes = sorted(set().union(*(r["nodes"] for r in returns)))


def write_task_fragments(table: TableRef, rows: pa.Table | pa.RecordBatchReader,
                         schema: pa.Schema, policy: FragmentPolicy | None = None) -> list:
    """Data files of `rows` in `table`'s folder, from a task: nothing is visible until the
    driver passes the returned fragments to `commit_fragments`."""
    policy = policy or FragmentPolicy()
    # "overwrite": files of `schema`, even one the replaced table lacks (append refuses).
    return write_fragments(
        rows, table.uri, schema=schema, mode="overwrite", max_rows_per_file=policy.max_rows,
        max_bytes_per_file=policy.target_bytes, storage_options=table.lance_options())


def commit_fragments(table: TableRef, fragments: list, schema: pa.Schema,
                     read_version: int | None) -> int:
    """The fragments the tasks wrote as the table's whole new version, in one commit that
    fails (`CommitConflictError`) if another writer committed since `read_version`."""
    failpoint("storage.overwrite_uncommitted")
    try:
        return lance.LanceDataset.commit(
            table.uri, lance.LanceOperation.Overwrite(schema, fragments),
            read_version=read_version, max_retries=0,
            storage_options=table.lance_options()).version
    except OSError as exc:
        latest = table.latest_version()
        if latest == read_version:
            raise  # not a lost race: a real failure
        raise CommitConflictError(
            f"cannot commit {table}: another writer committed version {latest} while "
            f"this write (based on version {read_version}) ran; this write's "
            f"{len(fragments)} fragment(s) were not committed and the table keeps the "
            "other writer's version: rerun to replace it") from exc


def tag_with_node(table: pa.Table) -> pa.Table:
    """Mark a block with the Ray node that produced it, so the write can report where the
    work ran (the sink strips the tag)."""
    node = ray.get_runtime_context().get_node_id()
    return table.replace_schema_metadata({**(table.schema.metadata or {}), NODE_TAG: node})


def _record_batches(blocks: Iterable[Block], nodes: set[str]):
    for block in blocks:
        table = BlockAccessor.for_block(block).to_arrow()
        metadata = table.schema.metadata or {}
        if NODE_TAG in metadata:
            nodes.add(metadata[NODE_TAG].decode())
            table = table.replace_schema_metadata(
                {k: v for k, v in metadata.items() if k != NODE_TAG} or None)
        yield from table.to_batches()


def _chain_first(first: pa.RecordBatch, rest, schema: pa.Schema):
    yield first.cast(schema) if first.schema != schema else first
    for batch in rest:
        yield batch.cast(schema) if batch.schema != schema else batch


def _existing_schema(table: TableRef) -> pa.Schema | None:
    try:
        return table.open().schema
    except FileNotFoundError:
        return None


def write_dataset_atomically(dataset: ray.data.Dataset, table: TableRef, policy: FragmentPolicy,
                             schema: pa.Schema | None = None) -> WriteReport:
    """Stream a Ray Dataset into `table` as one new version, then compact its fragments."""
    table = table.latest()
    prepare_output_dir(table, "Lance table")
    sink = LanceOverwriteSink(table, policy, schema, read_version=table.latest_version())
    dataset.write_datasink(sink)
    # In a task: Lance's compaction holds rows of the fragments it merges, and the driver
    # kept what it grew (duplicates' driver peaked there: +20 MB for 190,000 rows).
    compacted_from = ray.get(ray.remote(num_cpus=0)(compact).remote(table, policy))
    written = table.open()
    cleanup(written, policy)
    report = describe_write(written)
    report.nodes = sink.nodes
    report.compacted_from = compacted_from
    return report


def compact(table: TableRef, policy: FragmentPolicy, session: lance.Session | None = None
            ) -> int:
    """Merge small fragments toward the byte target; returns the fragment count before."""
    dataset = table.latest().open(session)
    fragments = dataset.get_fragments()
    if len(fragments) <= 1 or dataset.count_rows() == 0:
        return len(fragments)
    dataset.optimize.compact_files(
        target_rows_per_fragment=target_rows(dataset, policy),
        max_bytes_per_file=policy.target_bytes,
    )
    return len(fragments)


def allowed_fragments(dataset: lance.LanceDataset, policy: FragmentPolicy, slack: int = 1
                      ) -> int:
    """The fragments a healthy table holds: what a compaction leaves (~ceil(bytes / target),
    ~ceil(rows / max_rows), at least one) plus `slack` (the `fragments_healthy` check's
    bound)."""
    by_bytes = math.ceil(data_bytes(dataset) / policy.target_bytes)
    by_rows = math.ceil(dataset.count_rows() / policy.max_rows)
    return max(1, by_bytes, by_rows) + slack


def needs_compaction(table: TableRef, policy: FragmentPolicy,
                     session: lance.Session | None = None) -> bool:
    """Whether the table holds more fragments than a healthy one (`allowed_fragments`):
    only then does a run compact. A run of a few chunks leaves a fragment or two a healthy
    table allows, and compacting them rewrote every row the run wrote (a first ingest of
    2,000 images: its 400 MB of image bytes written twice)."""
    dataset = table.latest().open(session)
    return len(dataset.get_fragments()) > allowed_fragments(dataset, policy)


def target_rows(dataset: lance.LanceDataset, policy: FragmentPolicy) -> int:
    """Rows of a full fragment of `dataset` under `policy` (its rows' size from the
    manifest's file sizes)."""
    bytes_per_row = max(1, data_bytes(dataset) // max(1, dataset.count_rows()))
    return max(1, min(policy.max_rows, policy.target_bytes // bytes_per_row))


def small_fragments(dataset: lance.LanceDataset, policy: FragmentPolicy) -> int:
    """Fragments holding under half a full fragment's rows: what a compaction merges."""
    half = target_rows(dataset, policy) // 2
    return sum(1 for fragment in dataset.get_fragments()
               if fragment.metadata.physical_rows < half)


def cleanup(table: lance.LanceDataset, policy: FragmentPolicy) -> None:
    """Drop versions past the retention window (not those `hold_version` holds) and files of
    interrupted writes; with a `superseded_grace`, every version superseded that long ago."""
    table.cleanup_old_versions(older_than=policy.keep_versions, delete_unverified=False,
                               error_if_tagged_old_versions=False)
    if policy.superseded_grace is not None:
        drop_superseded(table, policy.superseded_grace)


def describe_write(table: lance.LanceDataset) -> WriteReport:
    return WriteReport(
        uri=table.uri, version=table.version, rows=table.count_rows(),
        fragments=len(table.get_fragments()), bytes=data_bytes(table),
    )


def upsert(table: TableRef, rows: pa.Table, schema: pa.Schema, keys: list[str],
           session: lance.Session | None = None) -> int:
    """Commit `rows` atomically, replacing rows with the same keys (never doubling them);
    returns the new version. Used for chunked, resumable writes (captions, labels).

    Two writers racing on one table: Lance commits a version with a put that fails if that
    version exists (a conditional put on S3), so one commit wins; the other finds its merge
    preempted, merges again on top of the winner's version and commits that (up to
    `UPSERT_ATTEMPTS` times, then `CommitConflictError`). Neither writer's rows are lost and
    keys stay unique. A writer of many chunks passes one `session`: a merge looks its keys
    up through the key index, whose pages a fresh open would read again each time (at 10⁶
    rows: 0.3 s a chunk, against 15 ms with the cache kept)."""
    table = table.latest()
    rows = rows.cast(schema)
    prepare_output_dir(table, "Lance table")
    if not table.exists():
        created = _create_if_absent(table, rows, schema)
        if created is not None:
            return created
        # Another writer created the table first: merge into what it committed.
    for attempt in range(1, UPSERT_ATTEMPTS + 1):
        dataset = table.open(session)
        # The merge writes its files first and commits separately, so a lost commit is
        # redone from the winner's version (a merge's own retries are not bounded by us).
        transaction, _ = dataset.merge_insert(keys).when_matched_update_all() \
            .when_not_matched_insert_all().execute_uncommitted(rows)
        failpoint("storage.upsert_uncommitted")
        try:
            version = lance.LanceDataset.commit(table.uri, transaction,
                                                storage_options=table.lance_options()).version
        except lance.commit.CommitConflictError as exc:
            log.warning("upsert into %s lost its commit on version %d to a concurrent writer "
                        "(attempt %d of %d): merging again on top (%s)", table, dataset.version,
                        attempt, UPSERT_ATTEMPTS, str(exc).split(",")[0])
            continue
        if version != dataset.version + 1:
            # Rebased over another writer's commit: Lance finds keys two merges both
            # inserted, not keys a concurrent append (`append_new`) brought.
            version = drop_later_copies(table, keys, rows) or version
        return version
    raise CommitConflictError(
        f"upsert into {table}: lost the commit to concurrent writers {UPSERT_ATTEMPTS} times; "
        "none of these rows were committed, the other writers' rows are kept: rerun to "
        "commit them")


def append_new(table: TableRef, rows: pa.Table, schema: pa.Schema, keys: list[str],
               known_at: int | None, session: lance.Session | None = None
               ) -> tuple[int, bool]:
    """Append `rows` without looking their keys up: the caller knows they are distinct and
    were absent from `table` at version `known_at` (None: the table did not exist). Returns
    (version, clean): clean when the commit came straight after `known_at`, so no other
    writer's commit can hold these keys. Otherwise another writer committed in between:
    the keys of this chunk are checked and copies after the first are deleted
    (`drop_later_copies`), and the caller should merge-insert from then on. A writer's
    `session` keeps its caches across commits (without one, each commit built its own:
    the driver grew with the commits)."""
    table = table.latest()
    rows = rows.cast(schema)
    prepare_output_dir(table, "Lance table")
    if known_at is None:
        created = _create_if_absent(table, rows, schema)
        if created is not None:
            return created, True
        return upsert(table, rows, schema, keys), False
    base: str | lance.LanceDataset = table.uri if session is None else table.open(session)
    fragments = write_fragments(rows, base, schema=schema,
                                storage_options=table.lance_options())
    version = lance.LanceDataset.commit(base, lance.LanceOperation.Append(fragments),
                                        read_version=known_at,
                                        storage_options=table.lance_options()).version
    if version == known_at + 1:
        return version, True
    return drop_later_copies(table, keys, rows) or version, False


def _create_if_absent(table: TableRef, rows: pa.Table, schema: pa.Schema) -> int | None:
    """Commit `rows` as the table's first version, or return None if another writer created
    the table meanwhile. `write_dataset(mode="create")` is not enough for racing writers:
    its commit is an Overwrite, which Lance rebases over a concurrent first commit, so the
    loser silently replaces the winner's rows. An Overwrite committed with no read version
    and no retries fails instead when the table exists (or its first version appears while
    committing), and the caller merges."""
    fragments = write_fragments(rows, table.uri, schema=schema,
                                storage_options=table.lance_options())
    try:
        return lance.LanceDataset.commit(
            table.uri, lance.LanceOperation.Overwrite(schema, fragments), read_version=None,
            max_retries=0, storage_options=table.lance_options()).version
    except OSError:
        # Lost the race (the written files are orphans for cleanup to remove), or a real
        # failure, which must not be mistaken for "someone else created it".
        if table.exists():
            return None
        raise


class _FileLimits(TypedDict, total=False):
    """`lance.write_dataset`'s file-size arguments (Lance's defaults where absent)."""

    max_rows_per_file: int
    max_bytes_per_file: int


def overwrite_rows(table: TableRef, rows: pa.Table, schema: pa.Schema,
                   policy: FragmentPolicy | None = None) -> int:
    """`rows` as the table's whole new version, in one commit (created if absent): readers
    see the previous rows or these, never a mix. For small tables written whole."""
    prepare_output_dir(table, "Lance table")
    mode = "overwrite" if table.exists() else "create"
    return lance.write_dataset(rows.cast(schema), table.uri, schema=schema, mode=mode,
                               storage_options=table.lance_options(),
                               **fragment_sizes(policy)).version


def append_rows(table: TableRef, rows: pa.Table, schema: pa.Schema,
                policy: FragmentPolicy | None = None) -> int:
    """`rows` appended in one commit (the table created if absent); returns the version."""
    prepare_output_dir(table, "Lance table")
    return lance.write_dataset(rows.cast(schema), table.uri, schema=schema,
                               mode="append" if table.exists() else "create",
                               storage_options=table.lance_options(),
                               **fragment_sizes(policy)).version


def fragment_sizes(policy: FragmentPolicy | None) -> _FileLimits:
    """`write_dataset`'s file-size arguments for `policy` (Lance's defaults without one)."""
    if policy is None:
        return {}
    return {"max_rows_per_file": policy.max_rows, "max_bytes_per_file": policy.target_bytes}


def only_appended_since(table: TableRef, old_version: int, new_version: int) -> bool:
    """True when every row of `old_version` is in `new_version` as it was: each fragment of
    the old version is in the new one with the same files, deletions and overlays (what a
    commit that only appends, or a merge-insert that matched nothing, leaves). False after
    an update, a delete or a compaction, where the rows must be compared."""
    old = {f.fragment_id: f.metadata.to_json() for f in table.at(old_version).open()
           .get_fragments()}
    new = {f.fragment_id: f.metadata.to_json() for f in table.at(new_version).open()
           .get_fragments()}
    return all(new.get(fragment_id) == metadata for fragment_id, metadata in old.items())
