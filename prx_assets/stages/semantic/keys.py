"""Seeded keys of sample ids: what the semantic steps draw by, so that a draw depends on
which rows a space holds and on the seed, never on the order the tables store them in
(Ray Data writes a table's rows in whatever order its tasks finish: two runs over the same
images stored them in two orders, and drew two samples).

A key is a 64-bit hash of the id's bytes, mixed with the seed (splitmix64's finaliser over
the id's 8-byte words, vectorised over an Arrow array). Keeping the rows of the smallest
keys is a uniform draw without replacement; the same id keeps its key wherever it is read.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

_MIX_1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX_2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = 0x9E3779B97F4A7C15


def _mix(h: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: every input bit moves about half the output bits."""
    h = (h ^ (h >> np.uint64(30))) * _MIX_1
    h = (h ^ (h >> np.uint64(27))) * _MIX_2
    return h ^ (h >> np.uint64(31))


def id_keys(ids: pa.Array | pa.ChunkedArray, seed: int) -> np.ndarray:
    """A uint64 key per id (string), from its bytes and `seed` alone."""
    if isinstance(ids, pa.ChunkedArray):
        ids = ids.combine_chunks()
    ids = ids.cast(pa.large_binary())
    offsets = np.frombuffer(ids.buffers()[1], np.int64)[ids.offset:ids.offset + len(ids) + 1]
    data_buffer = ids.buffers()[2]
    data = np.frombuffer(data_buffer, np.uint8) if data_buffer is not None else np.zeros(0)
    data = data if data.size else np.zeros(1, np.uint8)  # only empty ids: nothing to read
    lengths = np.diff(offsets)
    words = _padded_words(data, offsets, lengths)
    start = _mix(np.array([((seed + 1) * _GOLDEN) % 2**64], np.uint64))
    h = start ^ lengths.astype(np.uint64)
    for column in range(words.shape[1]):  # only an id's own words: not the batch's width
        mixed = _mix(h ^ words[:, column])
        h = mixed if column == 0 else np.where(lengths > 8 * column, mixed, h)
    return h


def _padded_words(data: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """(ids, words) of uint64: each id's bytes zero-padded to a whole number of words."""
    width = max(8, -(-int(lengths.max(initial=0)) // 8) * 8)
    if lengths.size and lengths[0] and np.all(lengths == lengths[0]):  # a source's ids: one length
        length = int(lengths[0])
        padded = np.zeros((lengths.size, width), np.uint8)
        padded[:, :length] = data[offsets[0]:offsets[0] + lengths.size * length].reshape(-1, length)
    else:
        columns = np.arange(width)
        inside = columns < lengths[:, None]
        index = np.minimum(offsets[:-1, None] + columns, data.size - 1)
        padded = np.where(inside, data[index], 0).astype(np.uint8)
    return padded.view("<u8")


def unit_draws(keys: np.ndarray) -> np.ndarray:
    """The keys as floats in [0, 1): a seeded uniform draw per id."""
    return (keys >> np.uint64(11)).astype(np.float64) / float(2**53)


def key_order(ids: pa.Array | pa.ChunkedArray, seed: int) -> np.ndarray:
    """Row numbers in the order of their keys (ties, which equal ids alone make likely,
    in row order)."""
    return np.argsort(id_keys(ids, seed), kind="stable")
