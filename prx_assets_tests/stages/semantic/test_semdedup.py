import numpy as np
import pyarrow as pa
import pytest

from prx_assets.stages.semantic.semdedup import (
    SemDedupConfig,
    cluster_groups,
    largest_groups,
    partition,
    semantic_duplicates,
    union,
)
from prx_assets.stages.semantic.synthetic import pairs_of, planted_duplicates


def ids_of(n: int, source: str = "a") -> pa.Array:
    return pa.array([f"{source}:{i:06d}" for i in range(n)])


def predicted_group(table: pa.Table, n: int) -> np.ndarray:
    group = np.full(n, -1, np.int64)
    rows = [int(i.split(":")[1]) for i in table.column("id").to_pylist()]
    group[rows] = table.column("group").to_numpy()
    return group


def test_union_joins_chains_into_one_root():
    parent = union(np.arange(6), np.array([4, 1, 2]), np.array([5, 2, 3]))
    assert parent.tolist() == [0, 1, 1, 1, 4, 4]


def test_cluster_groups_thresholds_each_eps_on_cosine():
    angle = np.deg2rad([0.0, 10.0, 30.0, 90.0])  # cosines to row 0: 1, .985, .866, 0
    vectors = np.stack([np.cos(angle), np.sin(angle)], axis=1).astype(np.float32)
    labels = cluster_groups(vectors, [0.01, 0.05, 0.2], block_rows=2)
    assert labels[0].tolist() == [0, 1, 2, 3]
    assert labels[1].tolist() == [0, 0, 2, 3]
    assert labels[2].tolist() == [0, 0, 0, 3]  # 10 deg -> 30 deg is .94: chained


def test_planted_groups_found_with_high_recall_and_precision():
    data = planted_duplicates(4000, dim=64, topics=40, seed=1)
    result = semantic_duplicates(ids_of(4000), data.vectors, data.pixels,
                                 np.zeros(4000, np.int32), SemDedupConfig(cluster_rows=500))
    truth = data.true_pairs()
    found = pairs_of(predicted_group(result.duplicates, 4000))
    assert len(truth) > 1000
    recall = len(found & truth) / len(truth)
    precision = len(found & truth) / max(1, len(found))
    assert recall >= 0.95, recall
    assert precision >= 0.95, precision
    assert result.clusters >= 4
    shares = result.removed_share()
    assert list(shares) == sorted(shares)
    assert shares[0.01] <= shares[0.02] <= shares[0.05] <= shares[0.1]
    assert shares[0.05] > 0.1


def test_kept_copy_follows_the_phash_policy_pixels_then_source_then_id():
    base = np.array([1.0, 0.0, 0.0], np.float32)
    vectors = np.stack([base, np.array([1, 0.01, 0]), np.array([1, 0, 0.01]), [0, 1, 0],
                        [0, 1, 0.01]]).astype(np.float32)
    ids = pa.array(["b:1", "a:2", "a:3", "c:1", "b:9"])
    pixels = np.array([100, 400, 400, 50, 50])
    rank = np.array([1, 0, 0, 2, 1])
    table = semantic_duplicates(ids, vectors, pixels, rank, SemDedupConfig(clusters=1)
                                ).duplicates
    kept = dict(zip(table.column("id").to_pylist(), table.column("kept_id").to_pylist(),
                    strict=True))
    # Most pixels wins (a:2 and a:3 tie on pixels and source: the smaller id); then the
    # source listed first (b before c) at equal pixels.
    assert kept == {"b:1": "a:2", "a:2": "a:2", "a:3": "a:2", "c:1": "b:9", "b:9": "b:9"}
    sizes = dict(zip(table.column("id").to_pylist(), table.column("group_size").to_pylist(),
                     strict=True))
    assert sizes["a:3"] == 3 and sizes["c:1"] == 2
    assert min(table.column("similarity").to_pylist()) > 0.99
    assert largest_groups(table)[0] == {"group_size": 3, "kept_id": "a:2",
                                        "ids": "a:2, a:3, b:1"}


def test_no_duplicates_gives_an_empty_table_and_zero_shares():
    rng = np.random.default_rng(0)
    vectors = rng.normal(size=(300, 64)).astype(np.float32)
    result = semantic_duplicates(ids_of(300), vectors, np.ones(300), np.zeros(300),
                                 SemDedupConfig(cluster_rows=100))
    assert result.duplicates.num_rows == 0
    assert set(result.removed_share().values()) == {0.0}
    empty = semantic_duplicates(pa.array([], pa.string()), np.zeros((0, 8), np.float32),
                                np.zeros(0), np.zeros(0))
    assert empty.rows == 0 and empty.duplicates.num_rows == 0


def test_clusters_above_the_cap_are_split_again():
    data = planted_duplicates(3000, dim=32, topics=30, seed=2)
    clusters = partition(data.vectors, SemDedupConfig(clusters=2, cluster_cap=400))
    assert max(c.size for c in clusters) <= 400
    assert sorted(np.concatenate(clusters).tolist()) == list(range(3000))


def test_bad_eps_is_refused():
    with pytest.raises(ValueError, match="eps"):
        SemDedupConfig(eps=1.5)
