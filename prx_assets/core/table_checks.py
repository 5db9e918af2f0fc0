"""Invariants of written tables, computed without loading image bytes."""

from __future__ import annotations

import math
from dataclasses import dataclass

import lance
import pyarrow.compute as pc
import ray.data

from prx_assets.core.lance_tables import FragmentPolicy, _data_bytes


# Up to this many rows the ids are counted in this process (~50 MB of ids at most): a Ray
# shuffle costs tens of seconds of task and actor start-up however small the table (38 s
# for 2,000 rows in bench/scale.py, three tables per source).
LOCAL_COUNT_ROWS = 1_000_000


def duplicate_ids(uri: str, column: str = "id", limit: int = 10) -> tuple[int, list[str]]:
    """(number of ids seen more than once, up to `limit` examples): counted in memory for
    tables up to LOCAL_COUNT_ROWS, via a Ray hash shuffle above, so the check scales past
    one machine's memory."""
    rows = lance.dataset(uri).count_rows()
    if rows <= LOCAL_COUNT_ROWS:
        return _duplicate_ids_in_memory(uri, column, limit)
    # ~1M ids per shuffle partition: small tables don't pay for hundreds of reduce tasks.
    partitions = max(1, min(200, rows // 1_000_000))
    counts = ray.data.read_lance(uri, columns=[column]).groupby(
        column, num_partitions=partitions).count()
    repeated = counts.filter(lambda row: row["count()"] > 1)
    examples = [row[column] for row in repeated.take(limit)]
    return (repeated.count() if examples else 0), examples


def _duplicate_ids_in_memory(uri: str, column: str, limit: int) -> tuple[int, list[str]]:
    counts = pc.value_counts(lance.dataset(uri).to_table(columns=[column]).column(column))
    repeated = counts.filter(pc.greater(counts.field("counts"), 1)).field("values")
    return len(repeated), sorted(repeated.to_pylist())[:limit]


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


def fragment_health(uri: str, policy: FragmentPolicy, slack: int = 1) -> FragmentHealth:
    """After compaction a table needs ~ceil(bytes/target) fragments; more means it is
    fragmenting (scans slow down 4-8x with many small fragments)."""
    table = lance.dataset(uri)
    total = _data_bytes(table)
    rows = table.count_rows()
    by_bytes = math.ceil(total / policy.target_bytes)
    by_rows = math.ceil(rows / policy.max_rows)
    return FragmentHealth(len(table.get_fragments()), total, rows,
                          allowed=max(1, by_bytes, by_rows) + slack)
