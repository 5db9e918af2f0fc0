"""Invariants of written tables, computed without loading image bytes.

Tables are `TableRef`s: local or on an object store, with their settings."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from prx_assets.storage.lance_tables import FragmentPolicy, allowed_fragments
from prx_assets.storage.reads import data_bytes
from prx_assets.storage.refs import TableRef

# Up to this many rows the check runs on the driver at 8 bytes per row (80 MB); above it, a
# Ray hash shuffle spreads it over the cluster. The shuffle has a fixed start-up cost of
# tens of seconds, which small tables should not pay.
DRIVER_CHECK_MAX_ROWS = 10_000_000


def duplicate_ids(table: TableRef, column: str = "id", limit: int = 10,
                  driver_max_rows: int = DRIVER_CHECK_MAX_ROWS) -> tuple[int, list[str]]:
    """(number of ids seen more than once, up to `limit` examples, sorted)."""
    table = table.pinned()
    rows = table.count_rows()
    if rows <= driver_max_rows:
        return _duplicates_streamed(table, column, limit)
    return _duplicates_shuffled(table, column, limit, rows)


def _id_batches(table: TableRef, column: str) -> Iterator[list]:
    for batch in table.open().to_batches(columns=[column], batch_size=1 << 16):
        yield batch.column(0).to_pylist()


def _duplicates_streamed(table: TableRef, column: str, limit: int) -> tuple[int, list[str]]:
    """Two streamed passes: 64-bit hashes of every id, sorted, give the candidate repeats;
    the second pass counts the exact values behind those hashes (collisions are not repeats)."""
    hashes = [np.fromiter(map(hash, ids), dtype=np.int64, count=len(ids))
              for ids in _id_batches(table, column)]
    flat = np.sort(np.concatenate(hashes)) if hashes else np.empty(0, np.int64)
    candidates = set(flat[1:][flat[1:] == flat[:-1]].tolist())
    if not candidates:
        return 0, []
    counts = Counter(value for ids in _id_batches(table, column) for value in ids
                     if hash(value) in candidates)
    repeated = sorted(value for value, count in counts.items() if count > 1)
    return len(repeated), repeated[:limit]


def _duplicates_shuffled(table: TableRef, column: str, limit: int,
                         rows: int) -> tuple[int, list[str]]:
    """A Ray hash shuffle: memory per task is bounded, so it scales past one machine."""
    # ~1M ids per shuffle partition: no more reduce tasks than the table needs.
    partitions = max(1, min(200, rows // 1_000_000))
    counts = table.read(columns=[column]).groupby(
        column, num_partitions=partitions).count()
    repeated = counts.filter(lambda row: row["count()"] > 1)
    examples = sorted(row[column] for row in repeated.take(limit))
    return (repeated.count() if examples else 0), examples


@dataclass(frozen=True)
class FragmentHealth:
    fragments: int
    total_bytes: int
    rows: int
    allowed: int

    @property
    def mean_bytes(self) -> float:
        return self.total_bytes / max(1, self.fragments)

    @property
    def healthy(self) -> bool:
        return self.fragments <= self.allowed


def fragment_health(ref: TableRef, policy: FragmentPolicy, slack: int = 1) -> FragmentHealth:
    """After compaction a table needs ~ceil(bytes/target) fragments; more means it is
    fragmenting (scans slow down 4-8x with many small fragments)."""
    table = ref.open()
    return FragmentHealth(len(table.get_fragments()), data_bytes(table), table.count_rows(),
                          allowed=allowed_fragments(table, policy, slack))
