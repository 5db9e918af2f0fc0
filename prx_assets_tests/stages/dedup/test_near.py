"""Near-duplicate pairs and clusters over arrays of phashes, against brute force."""

from __future__ import annotations

import numpy as np
import pytest

from prx_assets.stages.dedup import near


def _brute_pairs(hashes: np.ndarray, max_distance: int) -> set[tuple[int, int, int]]:
    values = hashes.view(np.uint64)
    found = set()
    for i in range(len(values)):
        for j in range(i + 1, len(values)):
            d = bin(int(values[i] ^ values[j])).count("1")
            if 1 <= d <= max_distance:
                found.add((i, j, d))
    return found


def _flipped(hash_: int, *bits: int) -> int:
    """`hash_` with the given bits flipped, as a signed int64 like the stored phashes."""
    value = np.array([hash_], np.int64).view(np.uint64)
    for bit in bits:
        value ^= np.uint64(1) << np.uint64(bit)
    return int(value.view(np.int64)[0])


def test_near_pairs_find_every_pair_within_four_bits():
    rng = np.random.default_rng(3)
    base = rng.integers(-(1 << 62), 1 << 62, 60, dtype=np.int64)
    hashes = [base]
    for bits in (1, 2, 3, 4, 5, 9):  # copies flipped in random bit positions, some far
        flipped = base.copy().view(np.uint64)
        for row in range(len(flipped)):
            for bit in rng.choice(64, bits, replace=False):
                flipped[row] ^= np.uint64(1) << np.uint64(bit)
        hashes.append(flipped.view(np.int64))
    unique = np.unique(np.concatenate(hashes))
    got = set(near.near_pairs(unique))
    assert got == _brute_pairs(unique, 4)
    assert {d for _, _, d in got} == {1, 2, 3, 4}


def test_near_pairs_refuse_a_distance_the_bands_cannot_guarantee():
    with pytest.raises(ValueError, match="max_distance"):
        near.near_pairs(np.zeros(1, np.int64), max_distance=5)


def test_hash_distance_counts_the_bits_of_signed_hashes():
    assert near.hash_distance(-1, 0) == 64
    assert near.hash_distance(_flipped(-5, 0, 63), -5) == 2
    assert near.hash_distance(7, 7) == 0


def test_clusters_chain_near_hashes_and_keep_exact_copies_together():
    a = -0x1234_5678_9ABC_DEF0
    b = _flipped(a, 1, 40, 63)  # 3 bits from a
    c = _flipped(b, 2, 3)  # 2 bits from b, 5 from a: joined through b
    d = _flipped(a, 10, 20, 30, 50, 60, 61)  # 6 bits from a: alone
    e = 0x0F0F_0F0F_0F0F_0F0F
    f = _flipped(e, 7)  # 1 bit from e
    hashes = np.array([c, a, d, b, e, a, f], np.int64)
    ids = ["s:c", "s:a2", "s:d", "s:b", "s:e", "s:a1", "s:f"]
    clusters = near.near_clusters(hashes, ids)
    assert [([ids[i] for i in cluster.rows], cluster.max_distance) for cluster in clusters] == [
        (sorted(["s:a1", "s:a2", "s:b", "s:c"], key=lambda i: (hashes[ids.index(i)], i)), 3),
        (sorted(["s:e", "s:f"], key=lambda i: (hashes[ids.index(i)], i)), 1)]
    assert near.near_clusters(np.array([a, a, d], np.int64), ["s:1", "s:2", "s:3"]) == []
    assert near.near_clusters(np.empty(0, np.int64), []) == []
