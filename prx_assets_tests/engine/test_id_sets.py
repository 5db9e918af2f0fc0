import numpy as np
import pyarrow as pa
import pytest

from prx_assets.engine.id_sets import IdSet


def random_ids(rng: np.random.Generator, n: int) -> list[str]:
    """Ids of 1-12 characters from a small alphabet (prefixes of each other often),
    some non-ASCII."""
    alphabet = list("ab:0é")
    return ["".join(rng.choice(alphabet, rng.integers(1, 13))) for _ in range(n)]


@pytest.mark.parametrize("seed", range(5))
def test_contains_agrees_with_a_python_set(seed):
    rng = np.random.default_rng(seed)
    members = random_ids(rng, 300)
    probes = random_ids(rng, 500) + members[:50] + ["ab" * 20]  # one longer than any member
    id_set = IdSet.of(pa.array(members))
    expected = [p in set(members) for p in probes]
    assert id_set.contains(pa.array(probes)).tolist() == expected
    assert id_set.contains(pa.array(probes, pa.large_string())).tolist() == expected
    chunked = pa.chunked_array([pa.array(probes[:200]), pa.array(probes[200:])])
    assert id_set.contains(chunked).tolist() == expected


def test_a_prefix_is_not_its_longer_id_and_nulls_are_in_no_set():
    id_set = IdSet.of(pa.array(["src:abc", None, "src:abd"]))
    assert len(id_set) == 2
    found = id_set.contains(pa.array(["src:ab", "src:abc", "src:abcd", None, "src:abd"]))
    assert found.tolist() == [False, True, False, False, True]


def test_an_empty_set_or_empty_block_finds_nothing():
    assert IdSet.of(pa.array([], pa.string())).contains(pa.array(["a", "b"])).tolist() == \
        [False, False]
    assert IdSet.of(pa.array(["a"])).contains(pa.array([], pa.string())).tolist() == []
