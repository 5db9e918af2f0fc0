"""Invariants of written tables, computed without loading image bytes.

Locations are local paths or object-store URIs; `storage_options` override the standard
AWS variables there (see `object_store.lance_options`)."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Iterator, Mapping, Optional

import lance
import numpy as np
import ray.data

from prx_assets.storage.lance_tables import FragmentPolicy, _data_bytes
from prx_assets.storage.object_store import lance_options

Options = Optional[Mapping[str, str]]


# Up to this many rows the check runs on the driver at 8 bytes per row (80 MB); above it, a
# Ray hash shuffle spreads it over the cluster. The shuffle has a fixed start-up cost of
# tens of seconds, which small tables should not pay.
DRIVER_CHECK_MAX_ROWS = 10_000_000


def duplicate_ids(uri: str, column: str = "id", limit: int = 10,
                  driver_max_rows: int = DRIVER_CHECK_MAX_ROWS,
                  storage_options: Options = None) -> tuple[int, list[str]]:
    """(number of ids seen more than once, up to `limit` examples, sorted)."""
    options = lance_options(uri, storage_options)
    rows = lance.dataset(uri, storage_options=options).count_rows()
    if rows <= driver_max_rows:
        return _duplicates_streamed(uri, column, limit, options)
    return _duplicates_shuffled(uri, column, limit, rows, options)


def _id_batches(uri: str, column: str, options: Options) -> Iterator[list]:
    table = lance.dataset(uri, storage_options=options)
    for batch in table.to_batches(columns=[column], batch_size=1 << 16):
        yield batch.column(0).to_pylist()


def _duplicates_streamed(uri: str, column: str, limit: int,
                         options: Options = None) -> tuple[int, list[str]]:
    """Two streamed passes: 64-bit hashes of every id, sorted, give the candidate repeats;
    the second pass counts the exact values behind those hashes (collisions are not repeats)."""
    hashes = [np.fromiter(map(hash, ids), dtype=np.int64, count=len(ids))
              for ids in _id_batches(uri, column, options)]
    flat = np.sort(np.concatenate(hashes)) if hashes else np.empty(0, np.int64)
    candidates = set(flat[1:][flat[1:] == flat[:-1]].tolist())
    if not candidates:
        return 0, []
    counts = Counter(value for ids in _id_batches(uri, column, options) for value in ids
                     if hash(value) in candidates)
    repeated = sorted(value for value, count in counts.items() if count > 1)
    return len(repeated), repeated[:limit]


def _duplicates_shuffled(uri: str, column: str, limit: int, rows: int,
                         options: Options = None) -> tuple[int, list[str]]:
    """A Ray hash shuffle: memory per task is bounded, so it scales past one machine."""
    # ~1M ids per shuffle partition: no more reduce tasks than the table needs.
    partitions = max(1, min(200, rows // 1_000_000))
    counts = ray.data.read_lance(uri, columns=[column], storage_options=options).groupby(
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


def fragment_health(uri: str, policy: FragmentPolicy, slack: int = 1,
                    storage_options: Options = None) -> FragmentHealth:
    """After compaction a table needs ~ceil(bytes/target) fragments; more means it is
    fragmenting (scans slow down 4-8x with many small fragments)."""
    table = lance.dataset(uri, storage_options=lance_options(uri, storage_options))
    total = _data_bytes(table)
    rows = table.count_rows()
    by_bytes = math.ceil(total / policy.target_bytes)
    by_rows = math.ceil(rows / policy.max_rows)
    return FragmentHealth(len(table.get_fragments()), total, rows,
                          allowed=max(1, by_bytes, by_rows) + slack)
