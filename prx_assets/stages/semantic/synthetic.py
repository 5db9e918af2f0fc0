"""Synthetic embeddings with known answers, shared by the tests and the bench.

- `planted_duplicates`: a mixture of topics (so k-means has structure to find) in which
  some samples have near copies (cosine to their original >= ~0.975, as re-encodes and
  small edits of one image are in an image encoder's space); the planted groups are the
  ground truth of SemDeDup.
- `long_tailed_mixture`: topics whose sizes follow a power law, the shape of web data
  that concept balancing flattens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from prx_assets.stages.semantic.kmeans import normalise


@dataclass(frozen=True)
class Planted:
    vectors: np.ndarray  # (n, d) unit rows
    group: np.ndarray  # (n,) planted group number, -1 for a sample with no copy
    pixels: np.ndarray  # (n,) int64

    def true_pairs(self) -> set[tuple[int, int]]:
        return pairs_of(self.group)


def pairs_of(group: np.ndarray) -> set[tuple[int, int]]:
    """Every pair (i < j) of rows that share a group number (>= 0)."""
    members: dict[int, list[int]] = {}
    for row, g in enumerate(group.tolist()):
        if g >= 0:
            members.setdefault(g, []).append(row)
    return {(a, b) for rows in members.values() for x, a in enumerate(rows) for b in rows[x + 1:]}


def planted_duplicates(n: int, dim: int = 128, topics: int = 200, copy_share: float = 0.2,
                       max_copies: int = 4, noise: tuple[float, float] = (0.03, 0.22),
                       seed: int = 0, topic_seed: int | None = None) -> Planted:
    """`n` samples: originals drawn around `topics` centres, a `copy_share` of them with
    1..max_copies noisy copies (relative noise in `noise`), then all shuffled. The centres
    are drawn from `topic_seed` when given (more samples of the same topics), else from
    `seed`."""
    rng = np.random.default_rng(seed)
    originals = n
    copies = np.where(rng.random(originals) < copy_share,
                      rng.integers(1, max_copies + 1, originals), 0)
    sizes = copies + 1
    sizes = sizes[:np.searchsorted(np.cumsum(sizes), n, side="right")]
    sizes = np.r_[sizes, np.ones(n - int(sizes.sum()), np.int64)]  # singletons fill up to n
    centres = rng.normal(size=(topics, dim))
    if topic_seed is not None:
        centres = np.random.default_rng(topic_seed).normal(size=(topics, dim))
    bases = centres[rng.integers(topics, size=sizes.size)]
    bases += rng.normal(size=(sizes.size, dim)) * 0.9
    bases /= np.linalg.norm(bases, axis=1, keepdims=True)
    owner = np.repeat(np.arange(sizes.size), sizes)
    first = np.r_[0, np.cumsum(sizes)[:-1]]
    is_copy = np.ones(n, bool)
    is_copy[first] = False
    jitter = rng.normal(size=(int(is_copy.sum()), dim))
    jitter *= (rng.uniform(*noise, size=len(jitter)) / np.linalg.norm(jitter, axis=1))[:, None]
    vectors = bases[owner]
    vectors[is_copy] += jitter
    group = np.where(sizes[owner] > 1, owner, -1)
    order = rng.permutation(n)
    pixels = rng.integers(1, 16, size=n).astype(np.int64) * 65_536
    return Planted(normalise(vectors[order]), group[order], pixels)


def long_tailed_mixture(topics: int = 60, largest: int = 4000, exponent: float = 1.2,
                        dim: int = 32, spread: float = 0.01, seed: int = 0
                        ) -> tuple[np.ndarray, np.ndarray]:
    """(unit vectors, topic per vector): topic t has about largest / (t+1)**exponent
    members (at least 5), tightly around its own random centre (`spread`: a wider topic is
    split by k-means into several leaves, which flattens the leaves before any balancing)."""
    rng = np.random.default_rng(seed)
    sizes = np.maximum(5, (largest / np.arange(1, topics + 1) ** exponent).astype(int))
    centres = normalise(rng.normal(size=(topics, dim)))
    topic = np.repeat(np.arange(topics), sizes)
    vectors = centres[topic] + rng.normal(size=(topic.size, dim)) * spread
    return normalise(vectors), topic
