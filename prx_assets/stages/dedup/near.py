"""Near duplicates: images whose perceptual hashes differ in a few bits.

The pipeline removes exact duplicates only (Hamming distance 0, see `dedup.py`); near ones
are reported, never acted on (the `duplicates` asset's shares, the corpus browser's
clusters). Lance has no Hamming-distance operator, so they are found here, from arrays of
the stored phashes (signed int64, as the tables hold them):

- `near_pairs`: every pair of distinct hashes 1..4 bits apart, without comparing every
  pair. The 64 bits are split into five bands; two hashes within 4 bits agree on at least
  one band (pigeonhole), so sorting the hashes by each band and comparing neighbours that
  share its value finds every such pair.
- `near_clusters`: those pairs joined into clusters (union-find, single linkage) over rows
  of hashes and ids; rows with the same hash (exact copies) always share a cluster.

No Dagster and no I/O: the callers read the hashes and say what a cluster's rows are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MAX_DISTANCE = 4
# Neighbours compared per band in sort order (bounds the work when many hashes share a
# band value; past it a pair can be missed).
MAX_RUN = 64
# Five bands of 13, 13, 13, 13 and 12 bits: (shift, width).
BANDS = ((0, 13), (13, 13), (26, 13), (39, 13), (52, 12))

Pair = tuple[int, int, int]  # (i, j, distance), i < j


def hash_distance(a: int, b: int) -> int:
    """Bits in which two phashes differ (their stored signed values)."""
    return ((a ^ b) & 0xFFFF_FFFF_FFFF_FFFF).bit_count()


def near_pairs(hashes: np.ndarray, max_distance: int = MAX_DISTANCE,
               max_run: int = MAX_RUN) -> list[Pair]:
    """(i, j, distance) for the hashes i < j (indices into `hashes`, which must hold unique
    values) that lie 1..max_distance bits apart, sorted."""
    if not 0 <= max_distance < len(BANDS):
        raise ValueError(f"max_distance must be 0..{len(BANDS) - 1}: "
                         f"{len(BANDS)} bands find every pair up to that")
    values = np.asarray(hashes, np.int64).view(np.uint64)
    found: dict[tuple[int, int], int] = {}
    for shift, width in BANDS:
        band = (values >> np.uint64(shift)) & np.uint64((1 << width) - 1)
        order = np.argsort(band, kind="stable")
        sorted_band = band[order]
        for offset in range(1, max_run + 1):
            same = sorted_band[offset:] == sorted_band[:-offset]
            if not same.any():
                break
            left, right = order[:-offset][same], order[offset:][same]
            distance = np.bitwise_count(values[left] ^ values[right]).astype(np.int64)
            close = (distance >= 1) & (distance <= max_distance)
            for a, b, d in zip(left[close], right[close], distance[close], strict=True):
                found[(int(min(a, b)), int(max(a, b)))] = int(d)
    return [(a, b, d) for (a, b), d in sorted(found.items())]


@dataclass(frozen=True)
class NearCluster:
    """One cluster: its rows (indices into the arrays given), ordered by hash then id, and
    the largest distance of a pair that joined it."""

    rows: list[int]
    max_distance: int


def near_clusters(hashes: np.ndarray, ids: Sequence[str], max_distance: int = MAX_DISTANCE,
                  max_run: int = MAX_RUN) -> list[NearCluster]:
    """Clusters of the rows whose hash lies 1..max_distance bits from another member's,
    largest first (then by their first id). A row with no such neighbour is in none;
    `ids[i]` is row i's id, which orders the members."""
    hashes = np.asarray(hashes, np.int64)
    unique, inverse = np.unique(hashes, return_inverse=True)
    pairs = near_pairs(unique, max_distance, max_run)
    roots = _cluster_roots(pairs)
    worst: dict[int, int] = {}
    for a, _, distance in pairs:
        worst[roots[a]] = max(worst.get(roots[a], 0), distance)
    members: dict[int, list[int]] = {}
    for row in np.flatnonzero(np.isin(inverse, list(roots))).tolist():
        members.setdefault(roots[int(inverse[row])], []).append(row)
    clusters = [NearCluster(sorted(rows, key=lambda i: (int(hashes[i]), ids[i])), worst[root])
                for root, rows in members.items()]
    return sorted(clusters, key=lambda c: (-len(c.rows), ids[c.rows[0]]))


def _cluster_roots(pairs: list[Pair]) -> dict[int, int]:
    """Union-find over the items the pairs join: each such item's cluster root."""
    parent: dict[int, int] = {}

    def root(i: int) -> int:
        parent.setdefault(i, i)
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for a, b, _ in pairs:
        ra, rb = root(a), root(b)
        if ra != rb:
            parent[rb] = ra
    return {i: root(i) for i in list(parent)}
