"""SemDeDup: near duplicates in embedding space (Abbas et al. 2023, as NeMo Curator runs it).

1. Spherical k-means puts the unit vectors into K clusters (faiss; `kmeans.py`). A cluster
   larger than the cap is split again by k-means, so no pairwise task sees more than
   `cluster_cap` vectors: memory per task is bounded by the cap, not by the corpus.
2. Within each cluster (independent, so one Ray task each), every pair whose cosine
   similarity exceeds `1 - eps` is joined, block by block of the similarity matrix
   (`block_rows` x cluster rows floats at a time), into groups (connected components).
3. From each group one copy is kept by the pHash dedup's own policy (most pixels, then the
   source listed first, then the smallest id: `dedup.group_candidates`), the rest are the
   `semdedup` skip reason.

Pairs that straddle two k-means clusters are not compared (SemDeDup's trade: K clusters
cut the work by about K); the bench measures what that costs in recall on planted groups.
The share removed at several `eps` (the table the SemDeDup paper plots) comes from the same
pass: each block of similarities is thresholded once per `eps`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prx_assets.stages.dedup.dedup import group_candidates
from prx_assets.stages.semantic.keys import key_order
from prx_assets.stages.semantic.kmeans import assign, gpu_count, kmeans, normalise

if TYPE_CHECKING:
    import ray

DEFAULT_EPS = 0.05  # cosine > 0.95: re-encodes, crops and edits of one image, not look-alikes
REPORT_EPS = (0.01, 0.02, 0.05, 0.1)
DEFAULT_CLUSTER_ROWS = 5_000  # K = rows / this (NeMo's default K=50,000 for ~100M)
# The fit's rows per centroid, at least (faiss's own cap on what it trains on: 256).
DEFAULT_FIT_ROWS_PER_CENTROID = 256
DEFAULT_CLUSTER_CAP = 50_000  # ~10 GB of float32 similarities at 512 rows per block
DEFAULT_BLOCK_ROWS = 512
MAX_SPLIT_DEPTH = 3

SEMANTIC_DUPLICATES_SCHEMA = pa.schema([
    pa.field("id", pa.string(), nullable=False),
    pa.field("kept_id", pa.string(), nullable=False),
    pa.field("group", pa.int64(), nullable=False),  # the group's smallest row number
    pa.field("group_size", pa.int32(), nullable=False),
    pa.field("cluster", pa.int32(), nullable=False),  # the k-means cluster it was found in
    pa.field("similarity", pa.float32(), nullable=False),  # cosine to the kept copy
    # Whether skip lists act on the group (False: reported only, e.g. in the caption space).
    pa.field("applied", pa.bool_(), nullable=False),
])


@dataclass(frozen=True)
class SemDedupConfig:
    eps: float = DEFAULT_EPS
    clusters: int = 0  # K; 0: rows / cluster_rows
    cluster_rows: int = DEFAULT_CLUSTER_ROWS
    fit_rows_per_centroid: int = DEFAULT_FIT_ROWS_PER_CENTROID  # the streamed fit's sample
    cluster_cap: int = DEFAULT_CLUSTER_CAP
    block_rows: int = DEFAULT_BLOCK_ROWS
    report_eps: tuple[float, ...] = REPORT_EPS
    seed: int = 0
    use_gpu: bool | None = None  # None: when faiss reports a GPU

    def __post_init__(self) -> None:
        for eps in (self.eps, *self.report_eps):
            if not 0.0 <= eps < 1.0:
                raise ValueError(f"eps must lie in [0, 1): {eps}")
        if self.cluster_cap < 2 or self.block_rows < 1:
            raise ValueError("cluster_cap must be >= 2 and block_rows >= 1")

    def cluster_count(self, rows: int) -> int:
        return self.clusters or max(1, math.ceil(rows / max(1, self.cluster_rows)))

    def all_eps(self) -> list[float]:
        """Every eps computed, the acting one included, ascending."""
        return sorted({self.eps, *self.report_eps})


def partition(vectors: np.ndarray, config: SemDedupConfig,
              fit_order: np.ndarray | None = None) -> list[np.ndarray]:
    """Row numbers per cluster (non-empty ones), every cluster at most `cluster_cap` rows
    unless k-means cannot split it further (then it is compared whole). The k-means is fitted
    on the rows in `fit_order` (the streamed path's: by key, `keys.key_order`)."""
    fit = vectors if fit_order is None else vectors[fit_order]
    first = kmeans(fit, config.cluster_count(len(vectors)), config.seed, use_gpu=config.use_gpu)
    assignment = first.assignment if fit_order is None else assign(vectors, first.centroids)
    return split_large(vectors, _members(assignment), config, depth=0)


def _members(assignment: np.ndarray) -> list[np.ndarray]:
    order = np.argsort(assignment, kind="stable")
    bounds = np.flatnonzero(np.diff(assignment[order])) + 1
    return [part for part in np.split(order, bounds) if part.size]


def split_large(vectors: np.ndarray, clusters: list[np.ndarray], config: SemDedupConfig,
                 depth: int) -> list[np.ndarray]:
    out: list[np.ndarray] = []
    for rows in clusters:
        if rows.size <= config.cluster_cap or depth >= MAX_SPLIT_DEPTH:
            out.append(rows)
            continue
        parts = math.ceil(rows.size / config.cluster_cap) * 2
        sub = kmeans(vectors[rows], parts, config.seed + depth + 1, use_gpu=config.use_gpu)
        split = [rows[part] for part in _members(sub.assignment)]
        if len(split) == 1:  # identical vectors: nothing to split on
            out.append(rows)
        else:
            out.extend(split_large(vectors, split, config, depth + 1))
    return out


def roots(parent: np.ndarray) -> np.ndarray:
    """Pointer jumping until every entry names its tree's root."""
    while True:
        jumped = parent[parent]
        if np.array_equal(jumped, parent):
            return parent
        parent = jumped


def union(parent: np.ndarray, left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """Join the pairs (left[i], right[i]) in a union-find `parent` array, vectorised:
    the larger root of each pair points at the smaller until every pair shares a root."""
    parent = roots(parent)
    while left.size:
        a, b = parent[left], parent[right]
        apart = a != b
        if not apart.any():
            break
        low, high = np.minimum(a[apart], b[apart]), np.maximum(a[apart], b[apart])
        np.minimum.at(parent, high, low)
        parent = roots(parent)
        left, right = left[apart], right[apart]
    return parent


def cluster_groups(vectors: np.ndarray, eps_values: Sequence[float],
                   block_rows: int = DEFAULT_BLOCK_ROWS) -> np.ndarray:
    """Group labels (each row's group = its smallest row number) of one cluster's unit
    vectors, one row of labels per eps: rows are joined when cosine > 1 - eps."""
    n = len(vectors)
    parents = np.tile(np.arange(n, dtype=np.int64), (len(eps_values), 1))
    loosest = 1.0 - max(eps_values, default=0.0)
    for start in range(0, n, block_rows):
        block = vectors[start:start + block_rows] @ vectors[start:].T
        i, j = np.nonzero(block > loosest)  # few: candidates at the loosest eps only
        upper = j > i  # each pair once, never a row with itself
        i, j = i[upper], j[upper]
        similarity = block[i, j]
        for level, eps in enumerate(eps_values):
            close = similarity > 1.0 - eps
            if close.any():
                parents[level] = union(parents[level], i[close] + start, j[close] + start)
    return np.stack([roots(p) for p in parents]) if n else parents


ClusterRunner = Callable[[np.ndarray, list[np.ndarray], list[float], int],
                         Iterable[tuple[np.ndarray, np.ndarray]]]


def run_serially(vectors: np.ndarray, clusters: list[np.ndarray], eps_values: list[float],
                 block_rows: int) -> Iterable[tuple[np.ndarray, np.ndarray]]:
    """(rows, labels per eps) for each cluster, one after another in this process."""
    for rows in clusters:
        yield rows, cluster_groups(vectors[rows], eps_values, block_rows)


def ray_runner(rows_per_task: int = DEFAULT_CLUSTER_ROWS * 4, max_in_flight: int = 8
               ) -> ClusterRunner:
    """Clusters as Ray tasks (small ones batched up to `rows_per_task` rows a task), at most
    `max_in_flight` tasks' vectors in the object store at once; results in cluster order."""

    def run(vectors: np.ndarray, clusters: list[np.ndarray], eps_values: list[float],
            block_rows: int) -> Iterable[tuple[np.ndarray, np.ndarray]]:
        import ray

        task = ray.remote(num_cpus=1)(_groups_of_batch)
        pending: list[tuple[list[np.ndarray], ray.ObjectRef]] = []
        for batch in _task_batches(clusters, rows_per_task):
            pending.append((batch, task.remote([vectors[rows] for rows in batch], eps_values,
                                               block_rows)))
            if len(pending) >= max_in_flight:
                yield from _collect(*pending.pop(0))
        for batch, ref in pending:
            yield from _collect(batch, ref)

    return run


def _groups_of_batch(parts: list[np.ndarray], eps_values: list[float], block_rows: int
                     ) -> list[np.ndarray]:
    return [cluster_groups(part, eps_values, block_rows) for part in parts]


def _collect(batch: list[np.ndarray], ref: ray.ObjectRef
             ) -> Iterable[tuple[np.ndarray, np.ndarray]]:
    import ray

    yield from zip(batch, ray.get(ref), strict=True)


def _task_batches(clusters: list[np.ndarray], rows_per_task: int) -> list[list[np.ndarray]]:
    batches: list[list[np.ndarray]] = [[]]
    size = 0
    for rows in clusters:
        if batches[-1] and size + rows.size > rows_per_task:
            batches.append([])
            size = 0
        batches[-1].append(rows)
        size += rows.size
    return [b for b in batches if b]


@dataclass
class SemDedupResult:
    duplicates: pa.Table  # SEMANTIC_DUPLICATES_SCHEMA: every member of every group
    rows: int
    clusters: int
    largest_cluster: int
    removed_by_eps: dict[float, int] = field(default_factory=dict)
    on_gpu: bool = False

    def removed_share(self) -> dict[float, float]:
        return {eps: (n / self.rows if self.rows else 0.0)
                for eps, n in self.removed_by_eps.items()}


def semantic_duplicates(ids: pa.Array, vectors: np.ndarray, pixels: np.ndarray,
                        rank: np.ndarray, config: SemDedupConfig = SemDedupConfig(),
                        runner: ClusterRunner = run_serially) -> SemDedupResult:
    """The groups at `config.eps` with their kept copies, and the removed count at every
    eps of the report. `runner` runs the per-cluster step (serially here, Ray tasks in the
    asset: `ray_runner`)."""
    vectors = normalise(vectors)
    eps_values = config.all_eps()
    acting = eps_values.index(config.eps)
    clusters = partition(vectors, config, key_order(ids, config.seed)) if len(vectors) else []
    group = np.arange(len(vectors), dtype=np.int64)
    cluster_of = np.zeros(len(vectors), np.int32)
    removed = dict.fromkeys(eps_values, 0)
    for number, (rows, labels) in enumerate(runner(vectors, clusters, eps_values,
                                                   config.block_rows)):
        for eps, level in zip(eps_values, labels, strict=True):
            removed[eps] += int(rows.size - np.unique(level).size)
        group[rows] = rows[labels[acting]]
        cluster_of[rows] = number
    table = kept_copies(ids, group, pixels, rank, cluster_of, vectors)
    on_gpu = gpu_count() > 0 if config.use_gpu is None else config.use_gpu
    return SemDedupResult(table, len(vectors), len(clusters),
                          max((c.size for c in clusters), default=0), removed, on_gpu)


def kept_copies(ids: pa.Array, group: np.ndarray, pixels: np.ndarray, rank: np.ndarray,
                cluster_of: np.ndarray, vectors: np.ndarray) -> pa.Table:
    """Every member of each group of two or more, with its kept copy: the pHash dedup's
    policy, applied by its own grouping function with the group number as the key."""
    sizes = np.bincount(group, minlength=len(group))
    members = np.flatnonzero(sizes[group] > 1)
    if members.size == 0:
        return SEMANTIC_DUPLICATES_SCHEMA.empty_table()
    taken = pa.array(members)
    candidates = pa.table({
        "id": pc.take(ids, taken), "phash": pa.array(group[members], pa.int64()),
        "pixels": pa.array(np.asarray(pixels, np.int64)[members]),
        "rank": pa.array(np.asarray(rank, np.int32)[members]),
    })
    grouped = group_candidates(candidates)
    row_of = dict(zip(candidates.column("id").to_pylist(), members.tolist(), strict=True))
    own = np.array([row_of[i] for i in grouped.column("id").to_pylist()], np.int64)
    kept = np.array([row_of[i] for i in grouped.column("kept_id").to_pylist()], np.int64)
    similarity = np.einsum("ij,ij->i", vectors[own], vectors[kept])
    return pa.table({
        "id": grouped.column("id"), "kept_id": grouped.column("kept_id"),
        "group": grouped.column("phash"), "group_size": grouped.column("group_size"),
        "cluster": pa.array(cluster_of[own], pa.int32()),
        "similarity": pa.array(np.minimum(similarity, 1.0).astype(np.float32)),
        "applied": pa.array(np.ones(len(own), bool)),
    }, schema=SEMANTIC_DUPLICATES_SCHEMA)


def reported_only(duplicates: pa.Table) -> pa.Table:
    """The same groups, marked as not acted on by skip lists."""
    index = duplicates.schema.get_field_index("applied")
    return duplicates.set_column(index, SEMANTIC_DUPLICATES_SCHEMA.field("applied"),
                                 pa.array(np.zeros(duplicates.num_rows, bool)))


def largest_groups(duplicates: pa.Table, top: int = 10, ids_shown: int = 5) -> list[dict]:
    """The `top` largest groups: size, kept id and the first few member ids."""
    if duplicates.num_rows == 0:
        return []
    by_group: dict[int, list[str]] = {}
    kept: dict[int, str] = {}
    for gid, member, keep in zip(duplicates.column("group").to_pylist(),
                                 duplicates.column("id").to_pylist(),
                                 duplicates.column("kept_id").to_pylist(), strict=True):
        by_group.setdefault(gid, []).append(member)
        kept[gid] = keep
    order = sorted(by_group, key=lambda g: (-len(by_group[g]), kept[g]))[:top]
    return [{"group_size": len(by_group[g]), "kept_id": kept[g],
             "ids": ", ".join(sorted(by_group[g])[:ids_shown])} for g in order]

