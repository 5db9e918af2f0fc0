"""Concepts: hierarchical k-means over an embedding space, and balanced sampling over it
(Vo et al. 2024, "Automatic data curation for self-supervised learning", the method of
Meta's `ssl-data-curation`).

Level 1 clusters the vectors into `sizes[0]` leaf clusters; each further level clusters the
previous level's centroids into fewer clusters, so every sample has one cluster per level
and each cluster's children are clusters of the level below.

Balancing is the paper's hierarchical sampling: a budget of `target` samples is spread
over the top level's clusters as evenly as their sizes allow (water-filling: a small
cluster gives all it has, the rest is shared among the larger ones), and each cluster's
share is spread over its children the same way, down to the leaves; a leaf keeps its share
of samples, drawn at random (seeded): its samples of smallest key, a seeded hash of each
id in the streamed step (`keys.id_keys`), so the draw does not follow the stored order.
Every non-empty leaf keeps at least one sample. The result is non-destructive: the
unselected samples become the `balance` skip reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from prx_assets.stages.semantic.kmeans import kmeans, normalise

MIN_LEVELS, MAX_LEVELS = 1, 4
DEFAULT_SIZES = (64, 8)  # leaves first; the demo corpus is small
DEFAULT_TARGET_SHARE = 0.5
# Fewer rows per leaf than this and k-means leaves are noise (the demo's 280 captions in 64
# leaves: 4 each); the levels are then scaled down together (`effective_sizes`).
MIN_ROWS_PER_LEAF = 16


@dataclass(frozen=True)
class ConceptTree:
    """`levels[l][i]`: sample i's cluster at level l+1 (level 1 = leaves, the finest);
    `parents[l][c]`: the level-(l+2) cluster of level-(l+1) cluster c."""

    levels: list[np.ndarray]
    parents: list[np.ndarray]
    centroids: list[np.ndarray]

    @property
    def leaves(self) -> np.ndarray:
        return self.levels[0]

    def sizes(self, level: int = 1) -> np.ndarray:
        """Samples per cluster at a level (1 = leaves), empty clusters included."""
        return np.bincount(self.levels[level - 1], minlength=len(self.centroids[level - 1]))


def check_sizes(sizes: Sequence[int]) -> tuple[int, ...]:
    sizes = tuple(int(s) for s in sizes)
    if not MIN_LEVELS <= len(sizes) <= MAX_LEVELS:
        raise ValueError(f"{len(sizes)} levels: between {MIN_LEVELS} and {MAX_LEVELS}")
    if any(s < 1 for s in sizes) or list(sizes) != sorted(sizes, reverse=True):
        raise ValueError(f"cluster counts per level must be >= 1 and shrink upwards: {sizes}")
    return sizes


def effective_sizes(sizes: Sequence[int], rows: int,
                    min_rows_per_leaf: int = MIN_ROWS_PER_LEAF) -> tuple[int, ...]:
    """`sizes`, scaled down by one factor when the leaves would hold fewer than
    `min_rows_per_leaf` rows on average (each level at least one cluster)."""
    sizes = check_sizes(sizes)
    factor = min(1.0, (rows // max(1, min_rows_per_leaf)) / sizes[0])
    scaled = [max(1, round(s * factor)) for s in sizes]
    return tuple(min(scaled[:i + 1]) for i in range(len(scaled)))


def hierarchical_kmeans(vectors: np.ndarray, sizes: Sequence[int] = DEFAULT_SIZES,
                        seed: int = 0, use_gpu: bool | None = None) -> ConceptTree:
    """Cluster ids per sample per level; leaves from the vectors, each level above from the
    centroids of the one below (weighted equally: a concept, not its size, is the unit)."""
    sizes = check_sizes(sizes)
    points = normalise(vectors)
    first = kmeans(points, sizes[0], seed, use_gpu=use_gpu, plus_plus=True)
    levels, parents, centroids = [first.assignment], [], [first.centroids]
    for depth, k in enumerate(sizes[1:], start=1):
        upper = kmeans(centroids[-1], k, seed + depth, use_gpu=use_gpu, plus_plus=True)
        parents.append(upper.assignment)
        centroids.append(upper.centroids)
        levels.append(upper.assignment[levels[-1]])
    return ConceptTree(levels, parents, centroids)


def water_fill(sizes: np.ndarray, budget: int) -> np.ndarray:
    """Integer shares of `budget` over groups of `sizes`, as even as the sizes allow: the
    largest cap c with sum(min(size, c)) <= budget, the remainder one each to the largest
    groups still below their size; every non-empty group gets at least one."""
    sizes = np.asarray(sizes, np.int64)
    if budget >= sizes.sum():
        return sizes.copy()
    low, high = 0, int(sizes.max())
    while low < high:  # the largest cap within budget
        cap = (low + high + 1) // 2
        if np.minimum(sizes, cap).sum() <= budget:
            low = cap
        else:
            high = cap - 1
    share = np.minimum(sizes, low)
    spare = budget - int(share.sum())
    open_groups = np.flatnonzero(share < sizes)
    order = open_groups[np.argsort(-sizes[open_groups], kind="stable")]
    share[order[:spare]] += 1
    return np.maximum(share, np.minimum(sizes, 1))


def leaf_budgets(tree: ConceptTree, target: int) -> np.ndarray:
    """Samples to keep per leaf: `target` water-filled from the top level down."""
    return budgets_of(tree.sizes(1), tree.parents, target)


def level_sizes(leaf_sizes: np.ndarray, parents: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Samples per cluster at every level (leaves first) from the leaves' sizes."""
    sizes = [np.asarray(leaf_sizes, np.int64)]
    for parent in parents:
        upper = int(parent.max()) + 1 if parent.size else 0
        sizes.append(np.bincount(parent, weights=sizes[-1], minlength=upper).astype(np.int64))
    return sizes


def budgets_of(leaf_sizes: np.ndarray, parents: Sequence[np.ndarray], target: int
               ) -> np.ndarray:
    """Samples to keep per leaf from the leaves' sizes and the levels' parents (what the
    streamed path knows without the samples' clusters): `leaf_budgets`."""
    sizes = level_sizes(leaf_sizes, parents)
    budgets = water_fill(sizes[-1], target)
    for level in range(len(sizes) - 1, 0, -1):  # from the top level down to the leaves
        children_parent = parents[level - 1]
        child_sizes = sizes[level - 1]
        child_budgets = np.zeros_like(child_sizes)
        for parent, budget in enumerate(budgets):
            children = np.flatnonzero(children_parent == parent)
            if children.size:
                child_budgets[children] = water_fill(child_sizes[children], int(budget))
        budgets = child_budgets
    return budgets


def balanced_selection(tree: ConceptTree, target: int, seed: int = 0,
                       keys: np.ndarray | None = None) -> np.ndarray:
    """A keep mask over the samples: each leaf's budget of its samples of smallest key
    (`keys`, one per sample; by default a seeded random draw)."""
    budgets = leaf_budgets(tree, target)
    if keys is None:
        keys = np.random.default_rng(seed).random(len(tree.leaves))
    keep = np.zeros(len(tree.leaves), bool)
    order = np.lexsort((keys, tree.leaves))  # by leaf, then by key within it
    bounds = np.r_[0, np.cumsum(tree.sizes(1))]
    for leaf, budget in enumerate(budgets):
        keep[order[bounds[leaf]:bounds[leaf] + int(budget)]] = True
    return keep


def largest_to_median(sizes: np.ndarray) -> float:
    """The flatness figure: largest non-empty cluster over the median one."""
    sizes = np.asarray(sizes)
    sizes = sizes[sizes > 0]
    return float(sizes.max() / np.median(sizes)) if sizes.size else 0.0


def size_histogram(sizes: np.ndarray, bins: int = 10) -> list[tuple[int, int, int]]:
    """(low, high, clusters) over log-spaced bins of non-empty cluster sizes."""
    sizes = np.asarray(sizes)
    sizes = sizes[sizes > 0]
    if sizes.size == 0:
        return []
    edges = np.unique(np.geomspace(1, sizes.max() + 1, bins + 1).astype(np.int64))
    counts, _ = np.histogram(sizes, bins=edges)
    return [(int(lo), int(hi) - 1, int(c))
            for lo, hi, c in zip(edges[:-1], edges[1:], counts, strict=True)]
