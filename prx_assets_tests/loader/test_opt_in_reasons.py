"""`balance` and named ablation lists are opt-in in the loader: skip_reasons=None applies the
reasons that apply by default (skip_lists.DEFAULT_REASONS) and counts the others."""

import gc
import json

import pytest

from prx_assets.loader import build_dataset
from prx_assets.stages.shards import mds, plan
from prx_assets.storage import trees
from prx_assets.storage.layout import Storage
from prx_assets.storage.sidecars import sidecar_path
from prx_assets.testing.mds_corpus import build_corpus, inputs_for
from prx_assets.testing.shared_memory import release_shared_memory

SHAPES = ((1, 48, 48),)


@pytest.fixture()
def tree(tmp_path):
    release_shared_memory(tmp_path)
    root = tmp_path / "data"
    build_corpus(root, "alpha", per_shape=12, shapes=SHAPES)
    mds.write_mds_tree(inputs_for(root, "alpha"), root, "alpha",
                       plan.WriteOptions(parallel=False))
    rows = Storage(root).table("mds_samples", "alpha").to_table().to_pylist()
    by_shard: dict = {}
    for row in rows:
        by_shard.setdefault((row["leaf"], row["shard"]), []).append(row["sample_index"])
    (leaf, shard), indices = sorted(by_shard.items())[0]
    indices = sorted(indices)
    lists = {"semdedup": indices[:2], "balance": indices[2:6], "no_blue": indices[6:7]}
    path = sidecar_path(trees.current_tree(root / "mds", "alpha") / leaf / shard)
    path.write_text(json.dumps({"version": 1, "lists": lists}))
    yield root / "mds"
    gc.collect()
    release_shared_memory(tmp_path)


def test_balance_and_ablations_apply_only_when_named(tree):
    default = build_dataset(tree, 1, 2, weights={"alpha": 1.0}, shuffle=False)
    assert default.skip_reasons == ["semdedup"]
    assert int(default.skipped.sum()) == 2
    assert default.skip_counts["balance"] == 4  # found and counted, not applied
    assert default.skip_counts["no_blue"] == 1  # an ablation list: the same
    del default
    balanced = build_dataset(tree, 1, 2, weights={"alpha": 1.0}, shuffle=False,
                             skip_reasons=["semdedup", "balance"])
    assert balanced.skip_reasons == ["balance", "semdedup"]
    assert int(balanced.skipped.sum()) == 6
    del balanced
    ablated = build_dataset(tree, 1, 2, weights={"alpha": 1.0}, shuffle=False,
                            skip_reasons=["semdedup", "no_blue"])
    assert ablated.skip_reasons == ["no_blue", "semdedup"]
    assert int(ablated.skipped.sum()) == 3


def test_a_tier_whose_every_sample_is_skipped_streams_an_empty_epoch(tree):
    """Found by the soak (seed 202, cycle 2: a tar removed, the samples of a tier all stale):
    a fresh loader raised ZeroDivisionError in streaming's partitioning of no samples."""
    root = tree.parent
    for row in Storage(root).table("mds_samples", "alpha").to_table().to_pylist():
        path = sidecar_path(trees.current_tree(root / "mds", "alpha") / row["leaf"] / row["shard"])
        lists = json.loads(path.read_text())["lists"] if path.exists() else {}
        lists.setdefault("semdedup", []).append(row["sample_index"])
        path.write_text(json.dumps({"version": 1, "lists": lists}))
    dataset = build_dataset(tree, 1, 1, weights={"alpha": 1.0}, shuffle=False)
    assert bool(dataset.skipped.all())
    assert list(dataset) == []


@pytest.mark.parametrize("batch_size", [1, 4])
def test_a_leaf_whose_every_sample_is_skipped_leaves_the_others_streaming(tmp_path, batch_size):
    """Found by the soak (seed 202 cycle 2, seed 12 cycle 1): with one leaf of a tier all
    skipped, streaming's per-stream batching divided by zero and a trainer crashed. The other
    leaf streams whole, each kept sample once, as many as len() says."""
    release_shared_memory(tmp_path)
    root = tmp_path / "data"
    build_corpus(root, "alpha", per_shape=6, shapes=((1, 48, 48), (1, 64, 48)), uncaptioned=0)
    mds.write_mds_tree(inputs_for(root, "alpha"), root, "alpha",
                       plan.WriteOptions(parallel=False))
    rows = Storage(root).table("mds_samples", "alpha").to_table().to_pylist()
    gone = min(row["leaf"] for row in rows)
    by_shard: dict = {}
    for row in rows:
        if row["leaf"] == gone:
            by_shard.setdefault(row["shard"], []).append(row["sample_index"])
    for shard, indices in by_shard.items():
        path = sidecar_path(trees.current_tree(root / "mds", "alpha") / gone / shard)
        path.write_text(json.dumps({"version": 1, "lists": {"semdedup": sorted(indices)}}))
    dataset = build_dataset(root / "mds", 1, batch_size, weights={"alpha": 1.0},
                            shuffle=True)
    ids = [sample["id"] for sample in dataset]
    expected = sorted(row["id"] for row in rows if row["leaf"] != gone)
    assert len(ids) == len(dataset) == len(expected) - len(expected) % batch_size
    assert len(set(ids)) == len(ids) and set(ids) <= set(expected)
    dataset.reader_leases.release()
    gc.collect()
    release_shared_memory(tmp_path)
