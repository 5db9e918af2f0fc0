"""Seeded id keys: a key follows the id and the seed alone, never the batch it is read in."""

import numpy as np
import pyarrow as pa

from prx_assets.stages.semantic.keys import id_keys, key_order, unit_draws


def test_an_ids_key_is_the_same_in_any_batch_and_any_order():
    ids = pa.array([f"web:{i}" for i in range(1000)] + ["a" * 41, ""])  # lengths differ
    keys = id_keys(ids, 3)
    assert np.array_equal(id_keys(ids.slice(10, 5), 3), keys[10:15])  # one length: other path
    assert np.array_equal(id_keys(pa.chunked_array([ids[:500], ids[500:]]), 3), keys)
    shuffled = np.random.default_rng(0).permutation(len(ids))
    assert np.array_equal(id_keys(ids.take(pa.array(shuffled)), 3), keys[shuffled])
    assert len(np.unique(keys)) == len(ids)


def test_the_seed_makes_another_draw():
    ids = pa.array([f"stock:{i:024x}" for i in range(2000)])
    first, other = key_order(ids, 0), key_order(ids, 1)
    assert not np.array_equal(first[:100], other[:100])
    assert np.array_equal(first, key_order(ids, 0))


def test_the_draws_are_uniform():
    draws = unit_draws(id_keys(pa.array([f"pq:{i}" for i in range(20_000)]), 7))
    assert draws.min() >= 0 and draws.max() < 1
    counts = np.histogram(draws, bins=10, range=(0, 1))[0]
    assert counts.min() > 1800 and counts.max() < 2200  # 2,000 a bin, ±4.5 sigma


def test_no_ids_no_keys():
    assert id_keys(pa.array([], pa.string()), 0).size == 0
