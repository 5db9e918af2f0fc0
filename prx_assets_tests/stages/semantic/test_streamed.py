"""The streamed global semantic steps against the in-memory ones: on a space no larger than
the fit's sample they write the same groups, kept copies and concepts; on a smaller sample
the planted groups are still found. In this process (`Tasks(use_ray=False)`), with small
chunks and buckets so several of each run."""

import numpy as np
import pyarrow as pa
import pytest

from prx_assets.stages.semantic import streamed
from prx_assets.stages.semantic.concepts import (
    balanced_selection,
    budgets_of,
    hierarchical_kmeans,
    leaf_budgets,
)
from prx_assets.stages.semantic.embeddings import write_embeddings
from prx_assets.stages.semantic.keys import id_keys, key_order
from prx_assets.stages.semantic.kmeans import assign, normalise
from prx_assets.stages.semantic.semdedup import (
    SemDedupConfig,
    cluster_groups,
    kept_copies,
    semantic_duplicates,
)
from prx_assets.stages.semantic.semdedup_streamed import (
    MAX_FIT_ROWS,
    fit_rows,
    fit_tag,
    read_fit,
    streamed_semantic_duplicates,
)
from prx_assets.stages.semantic.semdedup_update import incremental_semantic_duplicates
from prx_assets.stages.semantic.spaces import streamed_concepts
from prx_assets.stages.semantic.streamed import (
    DEFAULT_SAMPLE_ROWS,
    RAY_INLINE_BYTES,
    ROUTED_ROW_BYTES,
    Draw,
    Tasks,
    bucket_count,
    sample,
    space_inputs,
)
from prx_assets.stages.semantic.synthetic import long_tailed_mixture, pairs_of, planted_duplicates
from prx_assets.storage.lance_tables import overwrite_rows
from prx_assets.storage.layout import Storage

ENCODER = "enc"
SOURCES = ("web", "stock")


def write_space(root, vectors: np.ndarray, pixels: np.ndarray | None = None,
                order: np.ndarray | None = None) -> Storage:
    """The vectors split over two sources (each in three appends: several fragments), with
    a phashes table of their pixels; each source's rows stored as they come in `order`."""
    storage = Storage(root)
    rank = np.empty(len(vectors), np.int64)
    rank[np.arange(len(vectors)) if order is None else order] = np.arange(len(vectors))
    halves = np.array_split(np.arange(len(vectors)), 2)
    for source, rows in zip(SOURCES, halves, strict=True):
        rows = rows[np.argsort(rank[rows])]
        ids = [f"{source}:{i:06d}" for i in rows]
        for piece in np.array_split(np.arange(rows.size), 3):
            batch = pa.table({"id": [ids[i] for i in piece],
                              "embedding": vectors[rows[piece]].tolist()})
            write_embeddings(storage.table("image_embeddings", source), [batch], ENCODER, [])
        if pixels is not None:
            hashes = pa.table({"id": ids, "pixels": pa.array(pixels[rows], pa.int64())})
            overwrite_rows(storage.table("phashes", source), hashes, hashes.schema)
    return storage


def space_ids(n: int) -> pa.Array:
    halves = np.array_split(np.arange(n), 2)
    return pa.array([f"{s}:{i:06d}" for s, rows in zip(SOURCES, halves, strict=True)
                     for i in rows])


def rows_by_id(table: pa.Table) -> dict:
    return {r["id"]: (r["kept_id"], r["group"], r["group_size"], round(r["similarity"], 4),
                      r["applied"]) for r in table.to_pylist()}


def test_a_space_within_the_sample_gives_the_in_memory_groups(tmp_path):
    data = planted_duplicates(1200, dim=16, topics=12, seed=3)
    storage = write_space(tmp_path, data.vectors, data.pixels)
    inputs = space_inputs(storage, list(SOURCES), ENCODER)
    assert inputs.rows == 1200 and len(inputs.parts[1].fragments) == 3
    config = SemDedupConfig(cluster_rows=150, cluster_cap=120)
    out = storage.table("semantic_duplicates")
    result = streamed_semantic_duplicates(inputs, out, config, Tasks(use_ray=False),
                                          chunk_rows=97, bucket_rows=300)
    rank = np.repeat([0, 1], [600, 600]).astype(np.int32)
    expected = semantic_duplicates(space_ids(1200), data.vectors, data.pixels, rank, config)
    assert expected.duplicates.num_rows > 100
    assert rows_by_id(out.open().to_table()) == rows_by_id(expected.duplicates)
    assert result.removed_by_eps == expected.removed_by_eps
    assert (result.clusters, result.largest_cluster) == (expected.clusters,
                                                         expected.largest_cluster)
    assert result.sample_rows == 1200 and len(result.nodes) == 1
    assert result.largest == sorted(result.largest, key=lambda g: -g["group_size"])


def test_a_fit_on_a_sample_still_finds_the_planted_groups(tmp_path):
    data = planted_duplicates(3000, dim=32, topics=30, seed=4)
    storage = write_space(tmp_path, data.vectors)
    inputs = space_inputs(storage, list(SOURCES), ENCODER)
    out = storage.table("semantic_duplicates")
    config = SemDedupConfig(cluster_rows=300, fit_rows_per_centroid=60)
    result = streamed_semantic_duplicates(inputs, out, config, Tasks(use_ray=False),
                                          sample_rows=600, chunk_rows=500, bucket_rows=1000)
    assert result.sample_rows == 600
    table = out.open().to_table()
    index = {i: n for n, i in enumerate(space_ids(3000).to_pylist())}
    group = np.full(3000, -1, np.int64)
    group[[index[i] for i in table.column("id").to_pylist()]] = table.column("group").to_numpy()
    found, truth = pairs_of(group), data.true_pairs()
    assert len(found & truth) / len(truth) >= 0.95
    assert len(found & truth) / len(found) >= 0.95


def test_the_fit_grows_with_the_clusters_up_to_its_bound(tmp_path):
    data = planted_duplicates(1200, dim=16, topics=12, seed=3)
    inputs = space_inputs(write_space(tmp_path, data.vectors), list(SOURCES), ENCODER)
    config = SemDedupConfig(cluster_rows=100, fit_rows_per_centroid=70)  # K = 12
    out = Storage(tmp_path).table("semantic_duplicates")
    result = streamed_semantic_duplicates(inputs, out, config, Tasks(use_ray=False),
                                          sample_rows=300, chunk_rows=400)
    assert result.sample_rows == 12 * 70  # not the 300 asked for: 25 rows a centroid
    assert fit_rows(10**9, config, 300) == MAX_FIT_ROWS
    assert fit_rows(1200, SemDedupConfig(cluster_rows=100, fit_rows_per_centroid=10),
                    300) == 300


@pytest.mark.parametrize("size", [1, 37, 100, 250])
def test_the_draw_keeps_the_rows_of_smallest_key_in_key_order(size):
    rng = np.random.default_rng(size)
    keys = rng.integers(0, 2**64, 240, dtype=np.uint64)
    vectors = rng.normal(size=(240, 3)).astype(np.float32)
    drawn = Draw(size)
    for start in range(0, 240, 50):  # chunks of rows in order, as the tasks return them
        piece = slice(start, start + 50)
        drawn.add(keys[piece], np.arange(240)[piece], vectors[piece])
    kept = np.argsort(keys)[:size]
    assert np.array_equal(drawn.in_key_order(), vectors[kept])
    assert drawn.vectors is not None and len(drawn.vectors) == drawn.keys.size == size


def test_a_chunks_share_of_a_bucket_is_not_left_in_the_drivers_memory():
    # Shares under Ray's inline size are returned into the driver: past the budget, fewer
    # buckets keep every share of a mean chunk at twice that size.
    rows, chunk_rows, bucket_rows = 10**7, 62_500, 1 << 18
    buckets = bucket_count(rows, bucket_rows, chunk_rows, ROUTED_ROW_BYTES)
    assert 1 < buckets < bucket_count(rows, bucket_rows)
    assert chunk_rows * ROUTED_ROW_BYTES / buckets >= 2 * RAY_INLINE_BYTES
    # Shares with 64-d vectors are large enough already; a small space keeps its buckets.
    assert bucket_count(rows, bucket_rows, chunk_rows, ROUTED_ROW_BYTES + 4 * 64) == 39
    assert bucket_count(1200, 300, 97, ROUTED_ROW_BYTES) == 4


def test_the_sample_is_seeded_bounded_and_whole_when_the_space_fits(tmp_path):
    vectors = np.random.default_rng(0).normal(size=(500, 8)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    inputs = space_inputs(write_space(tmp_path, vectors), list(SOURCES), ENCODER)
    tasks = Tasks(use_ray=False)
    whole = vectors[key_order(space_ids(500), 0)]
    assert np.allclose(sample(inputs, tasks, 500, 0, chunk_rows=64), whole, atol=1e-6)
    drawn = sample(inputs, tasks, 100, 7, chunk_rows=64)
    assert drawn.shape == (100, 8)
    assert np.array_equal(drawn, sample(inputs, tasks, 100, 7, chunk_rows=64))
    assert not np.array_equal(drawn, sample(inputs, tasks, 100, 8, chunk_rows=64))
    assert np.array_equal(drawn, sample(inputs, tasks, 100, 7, chunk_rows=37))


def test_the_semantic_steps_draw_the_same_whatever_order_the_rows_are_stored_in(tmp_path):
    # Ray Data stores a table's rows in the order its tasks finish: two runs over the same
    # images can store them in two orders. The sample, the fit and the balanced picks
    # follow the ids, not the stored order.
    vectors, _ = long_tailed_mixture(topics=10, largest=120, dim=8, seed=2)
    tables = []
    for n, order in enumerate((np.arange(len(vectors)),
                               np.random.default_rng(1).permutation(len(vectors)))):
        storage = write_space(tmp_path / str(n), vectors, order=order)
        inputs = space_inputs(storage, list(SOURCES), ENCODER)
        streamed_concepts(inputs, storage.table("concepts"), (6, 2), 40, 0,
                          Tasks(use_ray=False), sample_rows=150, chunk_rows=50,
                          bucket_rows=100)
        tables.append(storage.table("concepts").open().to_table().sort_by(
            [("level", "ascending"), ("id", "ascending")]))
    assert tables[0].equals(tables[1])
    assert tables[0].filter(pa.compute.field("balanced")).num_rows >= 40


def test_streamed_concepts_match_the_in_memory_hierarchy_and_budgets(tmp_path):
    vectors, _ = long_tailed_mixture(topics=20, largest=400, dim=16, seed=5)
    storage = write_space(tmp_path, vectors)
    inputs = space_inputs(storage, list(SOURCES), ENCODER)
    out = storage.table("concepts")
    target = len(vectors) // 3
    result = streamed_concepts(inputs, out, (12, 3), target, 0, Tasks(use_ray=False),
                               chunk_rows=111, bucket_rows=len(vectors))
    ids = space_ids(len(vectors))
    order = key_order(ids, 0)  # the whole space is the fit's sample, in key order
    tree = hierarchical_kmeans(vectors[order], (12, 3), 0)
    assert np.array_equal(result.sizes[0], tree.sizes(1))
    assert np.array_equal(result.budgets, leaf_budgets(tree, target))
    table = out.open().to_table()
    leaves = table.filter(pa.compute.equal(table.column("level"), 1))
    index = {i: n for n, i in enumerate(ids.take(pa.array(order)).to_pylist())}
    rows = np.array([index[i] for i in leaves.column("id").to_pylist()])
    assert np.array_equal(leaves.column("cluster").to_numpy(), tree.leaves[rows])
    kept = leaves.column("balanced").to_numpy(zero_copy_only=False)
    # The in-memory path's very sample, given the same keys.
    keys = id_keys(ids, 0)[order]
    assert np.array_equal(kept, balanced_selection(tree, target, keys=keys)[rows])
    kept_per_leaf = np.bincount(tree.leaves[rows][kept], minlength=12)
    assert np.array_equal(kept_per_leaf, result.budgets)
    top = table.filter(pa.compute.equal(table.column("level"), 2))
    assert top.num_rows == len(vectors)
    one_bucket = set(leaves.filter(leaves.column("balanced")).column("id").to_pylist())
    several = streamed_concepts(inputs, out, (12, 3), target, 0, Tasks(use_ray=False),
                                chunk_rows=111, bucket_rows=400)
    balanced = out.open().to_table(filter="level = 1 AND balanced")
    assert balanced.num_rows == several.budgets.sum() == result.budgets.sum()
    assert set(balanced.column("id").to_pylist()) == one_bucket  # the buckets draw alike
    assert result.first_ids and all(len(v) <= 3 for v in result.first_ids.values())


def test_budgets_from_sizes_alone_are_the_trees():
    vectors, _ = long_tailed_mixture(topics=15, largest=300, dim=8, seed=1)
    tree = hierarchical_kmeans(vectors, (10, 4, 2), 0)
    assert np.array_equal(budgets_of(tree.sizes(1), tree.parents, 200),
                          leaf_budgets(tree, 200))


@pytest.mark.parametrize("rows", [0])
def test_an_empty_space_writes_empty_tables(tmp_path, rows):
    storage = Storage(tmp_path)
    inputs = space_inputs(storage, list(SOURCES), ENCODER)
    assert inputs.missing == list(SOURCES) and inputs.rows == rows
    result = streamed_semantic_duplicates(inputs, storage.table("semantic_duplicates"),
                                          SemDedupConfig(), Tasks(use_ray=False))
    assert result.rows == 0 and storage.table("semantic_duplicates").open().count_rows() == 0
    concepts = streamed_concepts(inputs, storage.table("concepts"), (4,), 0, 0,
                                 Tasks(use_ray=False))
    assert concepts.rows == 0 and storage.table("concepts").open().count_rows() == 0


def groups_at_fit(ids: pa.Array, vectors: np.ndarray, pixels: np.ndarray, rank: np.ndarray,
                  centroids: np.ndarray, config: SemDedupConfig) -> dict:
    """A full recompute at a given fit, in this process: {id: (kept id, size, cluster)}."""
    vectors = normalise(vectors)
    cluster = assign(vectors, centroids).astype(np.int32)
    group = np.arange(len(vectors))
    for c in np.unique(cluster):
        rows = np.flatnonzero(cluster == c)
        group[rows] = rows[cluster_groups(vectors[rows], [config.eps])[0]]
    table = kept_copies(ids, group, pixels, rank, cluster, vectors)
    return {r["id"]: (r["kept_id"], r["group_size"], r["cluster"]) for r in table.to_pylist()}


def chained(data, centroids: np.ndarray, eps: float) -> np.ndarray:
    """A vector within eps of one member A of a planted pair (A, B) and beyond eps of B, in
    A's cluster: it joins B's group only through A (on the arc from B through A)."""
    cluster = assign(data.vectors, centroids)
    for group in np.unique(data.group[data.group >= 0]):
        a, b = np.flatnonzero(data.group == group)[:2]
        va, vb = data.vectors[a].astype(np.float64), data.vectors[b].astype(np.float64)
        angle = np.arccos(np.clip(va @ vb, -1, 1))
        step = np.arccos(1 - eps) - angle / 4
        away = (va - vb) - ((va - vb) @ va) * va
        x = np.cos(step) * va + np.sin(step) * away / np.linalg.norm(away)
        if x @ vb < 1 - eps - 0.01 and x @ va > 1 - eps + 0.005 and assign(
                x[None].astype(np.float32), centroids)[0] == cluster[a]:
            return x[None].astype(np.float32)
    raise AssertionError("no planted pair to chain to")


def test_an_update_at_a_fixed_fit_equals_a_full_recompute_at_that_fit(tmp_path):
    data = planted_duplicates(1000, dim=16, topics=10, seed=6)
    storage = write_space(tmp_path, data.vectors, data.pixels)
    config = SemDedupConfig(cluster_rows=50, cluster_cap=10_000)
    out, clusters = storage.table("semantic_duplicates"), storage.table("semantic_clusters")
    inputs = space_inputs(storage, list(SOURCES), ENCODER)
    assert incremental_semantic_duplicates(inputs, out, clusters, config) is None  # no fit
    streamed_semantic_duplicates(inputs, out, config, Tasks(use_ray=False), chunk_rows=200,
                                 bucket_rows=400, clusters_out=clusters)
    centroids = read_fit(clusters, fit_tag(inputs, config, True, DEFAULT_SAMPLE_ROWS))[0]

    # stock gains near copies of three rows of planted groups (a new row joins a group and
    # its members are rewritten) and two new rows alike; web loses two rows in groups of
    # clusters no new row joins (only a deletion touches those).
    rng = np.random.default_rng(1)
    originals = rng.choice(np.flatnonzero(data.group >= 0), size=3, replace=False)
    copies = normalise(data.vectors[originals] + rng.normal(size=(3, 16)) * 0.01)
    pair = normalise(np.repeat(rng.normal(size=(1, 16)), 2, axis=0)
                     + rng.normal(size=(2, 16)) * 0.005)
    new = np.concatenate([copies, pair, chained(data, centroids, config.eps)])
    new_ids = [f"stock:{2000 + i:06d}" for i in range(len(new))]
    write_embeddings(storage.table("image_embeddings", "stock"),
                     [pa.table({"id": new_ids, "embedding": new.tolist()})], ENCODER, [])
    new_pixels = np.full(len(new), 5 * 65_536, np.int64)
    hashes = pa.table({"id": new_ids, "pixels": pa.array(new_pixels)})
    storage.table("phashes", "stock").open().insert(hashes)
    joined = set(assign(new, centroids).tolist())
    grouped = [r["id"] for r in out.open().to_table().to_pylist()
               if r["id"].startswith("web") and r["cluster"] not in joined]
    web = storage.table("image_embeddings", "web").open()
    web.delete(f"id IN ('{grouped[0]}', '{grouped[1]}')")

    inputs = space_inputs(storage, list(SOURCES), ENCODER)
    result = incremental_semantic_duplicates(inputs, out, clusters, config)
    assert result is not None and result.run == "update" and result.changed_rows == 8
    assert 0 < result.regrouped_rows < inputs.rows / 2
    ids = space_ids(1000).to_pylist()
    alive = [n for n, i in enumerate(ids) if i not in grouped[:2]]
    expected = groups_at_fit(
        pa.array([ids[n] for n in alive] + new_ids),
        np.concatenate([data.vectors[alive], new]),
        np.concatenate([data.pixels[alive], new_pixels]),
        np.r_[np.where(np.array(alive) < 500, 0, 1), np.ones(len(new))].astype(np.int32),
        centroids, config)
    got = {r["id"]: (r["kept_id"], r["group_size"], r["cluster"])
           for r in out.open().to_table().to_pylist()}
    assert got == expected
    assert set(new_ids) <= set(got)
    # Nothing changed since: nothing regrouped.
    again = incremental_semantic_duplicates(space_inputs(storage, list(SOURCES), ENCODER),
                                            out, clusters, config)
    assert again is not None and again.regrouped_rows == 0
    assert again.removed_by_eps[config.eps] == sum(1 for i, (k, _, _) in got.items() if i != k)


@pytest.mark.parametrize("lookup_ids", [4, 4096])
def test_the_pixel_lookup_finds_each_id_and_reads_a_big_set_in_one_scan(tmp_path, monkeypatch,
                                                                      lookup_ids):
    """Past `LOOKUP_IDS` distinct ids the pixels come from one scan, not an IN filter per
    batch (each read about the whole table); the same answers either way: duplicates, a
    missing id and a null pixels count included."""
    table = Storage(tmp_path).table("phashes", "web")
    ids = [f"web:{i:04d}" for i in range(300)]
    pixels = pa.array([None if i == 7 else 1000 + i for i in range(300)], pa.int64())
    overwrite_rows(table, pa.table({"id": ids, "pixels": pixels}),
                   pa.schema([("id", pa.string()), ("pixels", pa.int64())]))
    filters: list[int] = []
    real_filter = streamed.in_filter

    def counted(column, values):
        filters.append(len(values))
        return real_filter(column, values)

    monkeypatch.setattr(streamed, "in_filter", counted)
    monkeypatch.setattr(streamed, "LOOKUP_IDS", lookup_ids)
    wanted = pa.array(["web:0299", "web:0007", "web:9999", "web:0003", "web:0299", "web:0100"])
    got = streamed.pixels_of(wanted, np.zeros(len(wanted), np.int32), {0: table})
    assert got.tolist() == [1299, 0, 0, 1003, 1299, 1100]
    assert filters == ([] if lookup_ids < 5 else [5])
