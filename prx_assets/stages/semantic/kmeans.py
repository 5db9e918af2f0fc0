"""k-means through faiss: on the GPU when faiss sees one, on the CPU otherwise.

Vectors are L2-normalised rows (float32); the clustering is spherical (centroids are
renormalised), so "nearest centroid" is "largest cosine". Training runs on a seeded sample
(faiss's own `max_points_per_centroid` cap), assignment streams through the whole array in
chunks, so memory beyond the vectors themselves stays at one chunk of distances.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ASSIGN_CHUNK_ROWS = 1 << 16
ASSIGN_SCORES = 1 << 22  # scores per assignment chunk (16 MB): K grows with the corpus
DEFAULT_ITERATIONS = 20
# faiss subsamples to this many points per centroid for training (its own default).
MAX_POINTS_PER_CENTROID = 256


def gpu_count() -> int:
    """GPUs faiss can use (0 with faiss-cpu)."""
    import faiss

    get = getattr(faiss, "get_num_gpus", None)
    return int(get()) if get is not None else 0


def normalise(vectors: np.ndarray) -> np.ndarray:
    """Rows scaled to unit length (zero rows stay zero), float32 and C-contiguous."""
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return np.ascontiguousarray(vectors / np.maximum(norms, 1e-12), dtype=np.float32)


@dataclass(frozen=True)
class KMeansResult:
    centroids: np.ndarray  # (k, d) float32, unit rows
    assignment: np.ndarray  # (n,) int64: each vector's nearest centroid
    on_gpu: bool


def kmeans(vectors: np.ndarray, k: int, seed: int = 0, iterations: int = DEFAULT_ITERATIONS,
           use_gpu: bool | None = None, plus_plus: bool = False) -> KMeansResult:
    """Spherical k-means of unit rows into at most `k` clusters (never more than rows).

    `use_gpu=None` uses a GPU whenever faiss reports one. Empty clusters can remain (faiss
    splits large ones to refill them, which is not always possible); callers treat cluster
    ids as labels, not as a dense range of non-empty clusters. `plus_plus` seeds the
    centroids by k-means++ on a sample (faiss seeds with random points, which on long-tailed
    data puts most centroids in the largest concepts: what concept balancing must avoid).
    """
    import faiss

    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    n, d = vectors.shape
    if n == 0:
        return KMeansResult(np.zeros((0, d), np.float32), np.zeros(0, np.int64), False)
    k = max(1, min(int(k), n))
    on_gpu = gpu_count() > 0 if use_gpu is None else use_gpu
    if k == 1:
        centroid = normalise(vectors.mean(axis=0, keepdims=True))
        return KMeansResult(centroid, np.zeros(n, np.int64), False)
    model = faiss.Kmeans(d, k, niter=iterations, seed=seed, spherical=True, gpu=on_gpu,
                         max_points_per_centroid=MAX_POINTS_PER_CENTROID,
                         min_points_per_centroid=1, verbose=False)
    model.train(vectors, init_centroids=plus_plus_seeds(vectors, k, seed) if plus_plus else None)
    if model.centroids is None:  # faiss sets them in train(); None only before it
        raise RuntimeError("faiss k-means returned no centroids")
    centroids = normalise(model.centroids)
    return KMeansResult(centroids, assign(vectors, centroids), on_gpu)


def assign(vectors: np.ndarray, centroids: np.ndarray,
           chunk_rows: int | None = None) -> np.ndarray:
    """Each row's nearest centroid by inner product (cosine for unit rows), chunked: by
    default at most `ASSIGN_SCORES` scores at a time, whatever the number of centroids."""
    if chunk_rows is None:
        chunk_rows = max(256, min(ASSIGN_CHUNK_ROWS, ASSIGN_SCORES // max(1, len(centroids))))
    out = np.empty(len(vectors), np.int64)
    for start in range(0, len(vectors), chunk_rows):
        scores = vectors[start:start + chunk_rows] @ centroids.T
        out[start:start + chunk_rows] = scores.argmax(axis=1)
    return out


def plus_plus_seeds(vectors: np.ndarray, k: int, seed: int = 0, per_centroid: int = 64
                    ) -> np.ndarray:
    """k-means++ seeds (D^2 sampling) drawn from a sample of `per_centroid * k` rows."""
    rng = np.random.default_rng(seed)
    n = len(vectors)
    sample = vectors[rng.choice(n, size=min(n, per_centroid * k), replace=False)]
    seeds = np.empty((k, vectors.shape[1]), np.float32)
    seeds[0] = sample[rng.integers(len(sample))]
    nearest = np.maximum(0.0, 2.0 - 2.0 * (sample @ seeds[0]))  # squared distance, unit rows
    for i in range(1, k):
        total = float(nearest.sum())
        pick = rng.choice(len(sample), p=nearest / total) if total > 0 else rng.integers(
            len(sample))
        seeds[i] = sample[pick]
        nearest = np.minimum(nearest, np.maximum(0.0, 2.0 - 2.0 * (sample @ seeds[i])))
    return seeds
