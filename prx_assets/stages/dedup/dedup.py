"""Exact-duplicate grouping over every source's phashes (Hamming distance 0).

Within a group of images sharing a phash, the copy with the most pixels is kept; ties go
to the source listed first in the sources file, then to the smallest id. Flat images (a
uniform thumbnail) have meaningless hashes and never count as duplicates.

The grouping is a Ray job hash-partitioned on the phash: every row is assigned a bucket
from its hash, a shuffle brings each bucket to one task, and that task groups its bucket
with a vectorised sort. Memory per task is about rows / buckets, so the job scales with
the cluster; `reference_duplicates` is the obvious single-process version the tests (and
the bench) compare against.
"""

from __future__ import annotations

import functools
import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray.data
from ray.data.context import ShuffleStrategy

from prx_assets.storage.lance_tables import tag_with_node
from prx_assets.storage.layout import Storage, as_storage
from prx_assets.storage.refs import TableRef
from prx_assets.storage.tables import PHASHES

if TYPE_CHECKING:
    import lance

DUPLICATES_SCHEMA = pa.schema([
    pa.field("id", pa.string(), nullable=False),
    pa.field("kept_id", pa.string(), nullable=False),
    pa.field("phash", pa.int64(), nullable=False),
    pa.field("group_size", pa.int32(), nullable=False),
])
# What grouping needs per image: `rank` is the source's position in the sources file.
CANDIDATE_SCHEMA = pa.schema([
    pa.field("id", pa.string()), pa.field("phash", pa.int64()),
    pa.field("pixels", pa.int64()), pa.field("rank", pa.int32()),
])
NOT_FLAT = "phash IS NOT NULL AND (flat IS NULL OR flat = false)"
DEFAULT_ROWS_PER_BUCKET = 2_000_000  # ~150 MB of candidates per grouping task
# Rows one read task reads (~40 MB of candidates). Ray Data's executor runs in the driver
# and holds state per block: reading each Lance fragment as its own block (160 at 10^7 rows
# in the bench's 62,500-row fragments) grew the driver by ~40 MB.
DEFAULT_ROWS_PER_READ = 1 << 20
_MIX = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: spreads structured phash bits


@dataclass(frozen=True)
class HashInput:
    """One source's phashes table, pinned to the version that is read (lineage)."""

    source: str
    rank: int
    table: TableRef  # pinned

    @property
    def version(self) -> int | None:
        return self.table.version

    def open(self) -> lance.LanceDataset:
        return self.table.open()


def bucket_of(phash: np.ndarray, buckets: int) -> np.ndarray:
    """A bucket per hash, uniform even though phash bits are not independent."""
    mixed = phash.astype(np.int64).view(np.uint64) * _MIX
    # The product's high bits depend on every input bit; its low bits do not.
    return ((mixed >> np.uint64(32)) % np.uint64(buckets)).astype(np.int64)


def group_candidates(table: pa.Table) -> pa.Table:
    """Every member of every group of two or more equal phashes, with the kept id.

    `table` holds candidates (CANDIDATE_SCHEMA columns) and must contain every row of each
    phash it holds (one hash bucket, or everything). The kept copy is listed too, with
    `id == kept_id`, so a group can be read back from the table alone.
    """
    if table.num_rows == 0:
        return DUPLICATES_SCHEMA.empty_table()
    order = pc.sort_indices(table, sort_keys=[
        ("phash", "ascending"), ("pixels", "descending"), ("rank", "ascending"),
        ("id", "ascending")])
    ordered = table.take(order)
    hashes = ordered.column("phash").to_numpy(zero_copy_only=False)
    starts = np.flatnonzero(np.r_[True, hashes[1:] != hashes[:-1]])
    sizes = np.diff(np.r_[starts, len(hashes)])
    group_of_row = np.repeat(np.arange(len(starts)), sizes)
    size_of_row = sizes[group_of_row]
    in_group = np.flatnonzero(size_of_row > 1)
    kept = ordered.column("id").take(pa.array(starts[group_of_row[in_group]]))
    return pa.table({
        "id": ordered.column("id").take(pa.array(in_group)),
        "kept_id": kept,
        "phash": pa.array(hashes[in_group], pa.int64()),
        "group_size": pa.array(size_of_row[in_group], pa.int32()),
    }, schema=DUPLICATES_SCHEMA)


def reference_duplicates(candidates: Iterable[dict]) -> list[dict]:
    """The single-process definition of the result (for tests and as the bench baseline)."""
    groups: dict[int, list[dict]] = defaultdict(list)
    for row in candidates:
        groups[row["phash"]].append(row)
    out: list[dict] = []
    for phash, rows in groups.items():
        if len(rows) < 2:
            continue
        kept = min(rows, key=lambda r: (-r["pixels"], r["rank"], r["id"]))
        out.extend({"id": r["id"], "kept_id": kept["id"], "phash": phash,
                    "group_size": len(rows)} for r in rows)
    return sorted(out, key=lambda r: r["id"])


def _candidates(batch: pa.Table, rank: int, buckets: int) -> pa.Table:
    phash = batch.column("phash").to_numpy(zero_copy_only=False)
    return pa.table({
        "id": batch.column("id"), "phash": batch.column("phash"),
        "pixels": pc.fill_null(batch.column("pixels"), 0),
        "rank": pa.array(np.full(batch.num_rows, rank, np.int32)),
        "bucket": pa.array(bucket_of(phash, buckets)),
    })


def _group_bucket(batch: pa.Table) -> pa.Table:
    """One bucket's groups, tagged with the node that grouped them (the asset's `ray_nodes`
    records where the grouping ran, not only where the rows were written)."""
    return tag_with_node(group_candidates(batch.drop_columns(["bucket"])))


def bucket_count(rows: int, rows_per_bucket: int = DEFAULT_ROWS_PER_BUCKET) -> int:
    return max(1, math.ceil(rows / rows_per_bucket))


def read_tasks(rows: int, rows_per_read: int = DEFAULT_ROWS_PER_READ) -> int:
    """Read tasks (so blocks) for a table of `rows`: about `rows_per_read` rows each."""
    return max(1, math.ceil(rows / rows_per_read))


def duplicates_dataset(inputs: list[HashInput],
                       rows_per_bucket: int = DEFAULT_ROWS_PER_BUCKET,
                       shuffle: ShuffleStrategy = ShuffleStrategy.SORT_SHUFFLE_PULL_BASED,
                       rows_per_read: int = DEFAULT_ROWS_PER_READ) -> ray.data.Dataset:
    """The lazy Ray job: read non-flat hashes of every source, shuffle by hash bucket,
    group each bucket.

    The default shuffle moves whole buckets with Ray's sort-based exchange: on this
    machine Ray 2.60's actor-based hash shuffle spent ~25 s starting its aggregators for
    a few thousand rows, the sort-based one 0.3 s. Either way a bucket lands whole in one
    task, and buckets are drawn from a hash of the phash.

    The rows are counted from the tables' manifests, flat ones included: counting the
    non-flat ones scanned every table in the driver (+40-70 MB of Lance's buffers at 10^7
    rows), and the count only sizes the buckets.
    """
    datasets = []
    rows = {item.source: item.open().count_rows() for item in inputs}
    buckets = bucket_count(sum(rows.values()), rows_per_bucket)
    for item in inputs:
        ds = item.table.read(columns=["id", "phash", "pixels"], filter=NOT_FLAT,
                             override_num_blocks=read_tasks(rows[item.source], rows_per_read))
        datasets.append(ds.map_batches(
            functools.partial(_candidates, rank=item.rank, buckets=buckets),
            batch_format="pyarrow", batch_size=65_536))
    if not datasets:
        return ray.data.from_arrow(DUPLICATES_SCHEMA.empty_table())
    union = datasets[0].union(*datasets[1:]) if len(datasets) > 1 else datasets[0]
    union.context.shuffle_strategy = shuffle  # this dataset's own copy of the context
    return union.groupby("bucket", num_partitions=buckets).map_groups(
        _group_bucket, batch_format="pyarrow")


@dataclass
class DuplicateSummary:
    """What a person wants to see about a duplicates table."""

    rows_per_source: dict[str, int]
    removed_per_source: Counter = field(default_factory=Counter)
    groups: int = 0
    largest: list[dict] = field(default_factory=list)


def sources_of(ids: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    """The source of every id: ids are `<source>:<hash>` (core.ids.sample_id)."""
    return pc.list_element(pc.split_pattern(ids, ":", max_splits=1), 0)


def summarise(duplicates: TableRef, rows_per_source: dict[str, int], top: int = 10,
              batch_rows: int = 1 << 20) -> DuplicateSummary:
    """Removed copies per source and the largest groups, streamed in bounded batches and
    counted in Arrow (Python objects of a 2^20-row batch were ~250 MB in the driver)."""
    summary = DuplicateSummary(rows_per_source=rows_per_source)
    largest: list[tuple[int, int, str]] = []
    scanner = duplicates.open().scanner(
        columns=["id", "kept_id", "phash", "group_size"], batch_size=batch_rows)
    for batch in scanner.to_batches():
        kept = pc.equal(batch.column("id"), batch.column("kept_id"))
        removed = pc.value_counts(sources_of(batch.column("id").filter(pc.invert(kept))))
        for source, count in zip(removed.field("values").to_pylist(),
                                 removed.field("counts").to_pylist(), strict=True):
            summary.removed_per_source[source] += count
        groups = pa.Table.from_batches([batch]).filter(kept)
        summary.groups += groups.num_rows
        biggest = groups.take(pc.sort_indices(groups, sort_keys=[
            ("group_size", "descending"), ("kept_id", "ascending")])[:top])
        largest += zip(biggest.column("group_size").to_pylist(),
                       biggest.column("phash").to_pylist(),
                       biggest.column("kept_id").to_pylist(), strict=True)
        largest = sorted(largest, key=lambda g: (-g[0], g[2]))[:top]
    summary.largest = [{"phash": f"{p & 0xFFFFFFFFFFFFFFFF:016x}", "group_size": s,
                        "kept_id": k} for s, p, k in largest]
    return summary


def near_duplicate_shares(hashes: Iterator[np.ndarray], probes: np.ndarray,
                          max_distance: int = 4) -> dict[int, float]:
    """Share of `probes` whose nearest *different* hash lies within each distance 1..k.

    An estimate, only reported (the pipeline acts on distance 0 alone): `hashes` is
    streamed in chunks, so memory stays at one chunk times the probe count.
    """
    if probes.size == 0:
        return dict.fromkeys(range(1, max_distance + 1), 0.0)
    probe_bits = probes.astype(np.int64).view(np.uint64)
    nearest = np.full(probes.size, 65, np.int64)
    for chunk in hashes:
        bits = chunk.astype(np.int64).view(np.uint64)
        distance = np.bitwise_count(probe_bits[:, None] ^ bits[None, :]).astype(np.int64)
        distance[distance == 0] = 65  # equal hashes are exact duplicates, not near ones
        nearest = np.minimum(nearest, distance.min(axis=1, initial=65))
    return {d: float(np.mean(nearest <= d)) for d in range(1, max_distance + 1)}


def hash_inputs(storage: Storage | str | Path, sources: list[str]
                ) -> tuple[list[HashInput], list[str]]:
    """Each source's phashes table pinned at its latest version, and the sources that
    have none yet (reported, not fatal: dedup covers what has been hashed)."""
    storage = as_storage(storage)
    inputs, missing = [], []
    for rank, source in enumerate(sources):
        table = storage.table(PHASHES, source)
        version = table.latest_version()
        if version is None:
            missing.append(source)
            continue
        inputs.append(HashInput(source, rank, table.at(version)))
    return inputs, missing


def hashed_rows(inputs: list[HashInput]) -> dict[str, int]:
    """Non-flat hashed images per source: the denominator of the removed share."""
    return {i.source: i.open().count_rows(filter=NOT_FLAT) for i in inputs}


def near_duplicate_report(inputs: list[HashInput], probes: int = 256,
                          max_rows: int = 5_000_000, max_distance: int = 4,
                          chunk_rows: int = 65_536) -> dict[int, float]:
    """`near_duplicate_shares` on a sample of probes against up to `max_rows` hashes."""
    rng = np.random.default_rng(0)
    per_source = max(1, probes // max(1, len(inputs)))
    samples = []
    for item in inputs:
        table = item.open().to_table(
            columns=["phash"], filter=NOT_FLAT, limit=max(per_source * 16, 4096))
        hashes = table.column("phash").to_numpy(zero_copy_only=False)
        if hashes.size:
            samples.append(rng.choice(hashes, size=min(per_source, hashes.size), replace=False))
    probe_hashes = np.concatenate(samples) if samples else np.empty(0, np.int64)

    def chunks() -> Iterator[np.ndarray]:
        seen = 0
        for item in inputs:
            scanner = item.open().scanner(
                columns=["phash"], filter=NOT_FLAT, batch_size=chunk_rows)
            for batch in scanner.to_batches():
                if seen >= max_rows:
                    return
                yield batch.column("phash").to_numpy(zero_copy_only=False)
                seen += batch.num_rows

    return near_duplicate_shares(chunks(), probe_hashes, max_distance)
