"""The browser's concept views, over the `concepts` table (a cluster per sample per level):
the grid's concept facet (its counts and the ids behind one cluster), a page per cluster
(its samples, size, captions, nearest clusters) and the concepts of one sample.

Every read carries a limit or counts without reading. Nearest clusters are by the cosine
of cluster means: the table stores no centroids, so each cluster's centroid is the mean of
its members' caption embeddings (the corpus' `embedding` column), computed once per
(concepts, corpus) version over at most MAX_CENTROID_ROWS members.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prx_assets.browser.catalog import Catalog, NotFound
from prx_assets.browser.facets import MAX_ID_SET, IdSet
from prx_assets.storage.filters import eq_filter
from prx_assets.storage.tables import CONCEPTS

if TYPE_CHECKING:
    from lance import LanceDataset

MAX_LEVELS = 8  # a level beyond this cannot be one (the stage allows 4)
MAX_CENTROID_ROWS = 200_000
NEAREST_CLUSTERS = 8
MAX_COUNTED_ROWS = 1_000_000  # the facet counts a level's clusters among this many rows
CLUSTER_CAPTIONS = 5


def concepts_table(catalog: Catalog) -> LanceDataset | None:
    return catalog.dataset(CONCEPTS)


def levels(catalog: Catalog) -> list[int]:
    """The levels the concepts table holds (1 = leaves), [] without the table."""
    table = concepts_table(catalog)
    if table is None:
        return []
    return catalog.cached(("concept-levels", table.uri, table.version), lambda: [
        level for level in range(1, MAX_LEVELS + 1)
        if table.count_rows(filter=pc.field("level") == level)])


def _at(level: int, cluster: int | None = None) -> pc.Expression:
    where = pc.field("level") == level
    return where if cluster is None else where & (pc.field("cluster") == cluster)


def members(catalog: Catalog, level: int, cluster: int) -> IdSet:
    """The ids of one cluster (up to MAX_ID_SET), once per concepts version."""
    table = concepts_table(catalog)
    if table is None:
        return IdSet.of(())
    return catalog.cached(
        ("concept-members", table.uri, table.version, level, cluster),
        lambda: IdSet.of(table.to_table(columns=["id"], filter=_at(level, cluster),
                                        limit=MAX_ID_SET).column("id").to_pylist()))


def cluster_counts(catalog: Catalog, level: int, ids: pa.Array | None
                   ) -> list[tuple[str, int]]:
    """Samples per cluster of `level` among `ids` (every sample when None), largest first."""
    table = concepts_table(catalog)
    if table is None:
        return []
    if ids is None:  # the whole level: once per concepts version
        return catalog.cached(("concept-counts", table.uri, table.version, level),
                              lambda: _counts(table, _at(level)))
    return _counts(table, _at(level) & pc.field("id").isin(ids))


def _counts(table: LanceDataset, where: pc.Expression) -> list[tuple[str, int]]:
    rows = table.to_table(columns=["cluster"], filter=where, limit=MAX_COUNTED_ROWS)
    counts = pc.value_counts(rows.column("cluster"))
    pairs = [(str(c["values"].as_py()), int(c["counts"].as_py())) for c in counts]
    return sorted(pairs, key=lambda p: (-p[1], int(p[0])))


def of_sample(catalog: Catalog, sample_id: str) -> list[dict]:
    """(level, cluster) of one sample at every level."""
    table = concepts_table(catalog)
    if table is None:
        return []
    rows = table.to_table(columns=["level", "cluster"], filter=eq_filter("id", sample_id),
                          limit=MAX_LEVELS)
    return sorted(rows.to_pylist(), key=lambda r: r["level"])


# ------------------------------------------------------------------------- cluster page

@dataclass
class Cluster:
    level: int
    cluster: int
    size: int
    ids: list[str]  # the members shown (a page of tiles)
    captions: list[str]
    nearest: list[tuple[int, float, int]]  # (cluster, cosine of the means, its size)


def cluster(catalog: Catalog, level: int, cluster_id: int, shown: int) -> Cluster:
    """One cluster: its size, the first `shown` member ids, a few captions and its nearest
    clusters of the same level."""
    table = concepts_table(catalog)
    if table is None:
        raise NotFound("no concepts table yet: materialise the `concepts` asset")
    size = table.count_rows(filter=_at(level, cluster_id))
    if size == 0:
        raise NotFound(f"no cluster {cluster_id} at level {level}")
    ids = table.to_table(columns=["id"], filter=_at(level, cluster_id),
                         limit=shown).column("id")
    corpus = catalog.corpus()
    rows = corpus.to_table(columns=["caption"], filter=pc.field("id").isin(ids),
                           limit=CLUSTER_CAPTIONS)
    captions = [c for c in rows.column("caption").to_pylist() if c]
    return Cluster(level, cluster_id, size, ids.to_pylist(), captions,
                   nearest_clusters(catalog, level, cluster_id))


def nearest_clusters(catalog: Catalog, level: int, cluster_id: int,
                     k: int = NEAREST_CLUSTERS) -> list[tuple[int, float, int]]:
    """The clusters of `level` whose mean member vector is nearest (cosine) to this one's."""
    means, sizes = _cluster_means(catalog, level)
    if cluster_id not in means:
        return []
    labels = sorted(means)
    matrix = np.stack([means[c] for c in labels])
    similarity = matrix @ means[cluster_id]
    order = np.argsort(-similarity, kind="stable")
    return [(labels[i], round(float(similarity[i]), 3), sizes[labels[i]])
            for i in order if labels[i] != cluster_id][:k]


def _cluster_means(catalog: Catalog, level: int
                   ) -> tuple[dict[int, np.ndarray], dict[int, int]]:
    table, corpus = concepts_table(catalog), catalog.corpus()
    if table is None:
        return {}, {}

    def compute() -> tuple[dict[int, np.ndarray], dict[int, int]]:
        assigned = table.to_table(columns=["id", "cluster"], filter=_at(level),
                                  limit=MAX_CENTROID_ROWS)
        vectors = corpus.to_table(columns=["id", "embedding"],
                                  filter=pc.field("id").isin(assigned.column("id")),
                                  limit=MAX_CENTROID_ROWS)
        return cluster_means(assigned, vectors)

    return catalog.cached(("concept-means", table.uri, table.version, corpus.version, level),
                          compute)


def cluster_means(assigned: pa.Table, vectors: pa.Table
                  ) -> tuple[dict[int, np.ndarray], dict[int, int]]:
    """Unit mean vector and member count of each cluster, from (id, cluster) and
    (id, embedding) rows (members without a vector count but add nothing)."""
    clusters = assigned.column("cluster").to_numpy()
    sizes = {int(c): int(n) for c, n in zip(*np.unique(clusters, return_counts=True),
                                                strict=True)}
    if vectors.num_rows == 0:
        return {}, sizes
    flat = vectors.column("embedding").combine_chunks()
    points = flat.flatten().to_numpy(zero_copy_only=False).reshape(
        vectors.num_rows, flat.type.list_size).astype(np.float32)
    points /= np.maximum(np.linalg.norm(points, axis=1, keepdims=True), 1e-12)
    where = pc.index_in(vectors.column("id"), value_set=assigned.column("id"))
    found = where.is_valid().to_numpy(zero_copy_only=False)
    owner = clusters[where.to_numpy(zero_copy_only=False)[found].astype(np.int64)]
    labels = np.unique(owner)
    sums = np.zeros((len(labels), points.shape[1]), np.float32)
    np.add.at(sums, np.searchsorted(labels, owner), points[found])
    sums /= np.maximum(np.linalg.norm(sums, axis=1, keepdims=True), 1e-12)
    return {int(c): sums[i] for i, c in enumerate(labels)}, sizes
