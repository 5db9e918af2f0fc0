import dataclasses
import gc

import pytest

from prx_assets.loader import build_dataset
from prx_assets.stages.rewrite.rewrite import rewrite_without_skipped
from prx_assets.stages.shards import mds, plan
from prx_assets.stages.skip_lists.skip_lists import (
    apply_skip_lists,
    build_skip_lists,
    mapping_batches,
    mapping_shards,
)
from prx_assets.storage import trees
from prx_assets.storage.layout import Storage
from prx_assets.storage.sidecars import sidecar_files
from prx_assets.testing.mds_corpus import build_corpus, inputs_for

SHAPES = ((1, 48, 48), (1, 64, 48))


def _loader_ids(root) -> list[str]:
    # The ablation list is opt-in: named, as the training run that compares it would.
    dataset = build_dataset(root / "mds", tier=1, batch_size=1, weights={"web": 1.0},
                            shuffle=False, skip_reasons=["dedup", "nsfw", "no_blue"])
    ids = [dataset[i]["id"] for i in range(dataset.num_samples) if not dataset.skipped[i]]
    streamed = [sample["id"] for sample in dataset]
    del dataset
    gc.collect()
    assert sorted(ids) == sorted(streamed)
    return streamed


@pytest.mark.parametrize("plan_rows", [None, 7], ids=["one group", "in groups"])
def test_rewrite_yields_the_same_ids_and_empties_the_skip_lists(tmp_path, plan_rows):
    """In groups (of at most 7 rows: each leaf cut into ranges), the rewrite's exclusions
    and carried sidecars are applied group by group; the loader sees the same ids."""
    root = tmp_path / "data"
    options = plan.WriteOptions(size_limit=8_000, parallel=False)
    if plan_rows is not None:
        options = dataclasses.replace(options, plan_rows=plan_rows)
    build_corpus(root, "web", per_shape=20, shapes=SHAPES, uncaptioned=0)
    mds.write_mds_tree(inputs_for(root, "web"), root, "web", options)
    mapping = Storage(root).table("mds_samples", "web")
    ids = sorted(mapping.to_table(columns=["id"]).column("id").to_pylist())
    reasons = {"dedup": set(ids[::4]), "nsfw": set(ids[1:6]), "no_blue": set(ids[::7])}
    shards, _ = mapping_shards(mapping)
    assert len(shards) > 2
    apply_skip_lists(trees.current_tree(root, "web"), build_skip_lists(mapping_batches(mapping),
                                                                     reasons), shards)
    before = _loader_ids(root)
    skipped = set().union(*reasons.values())
    assert not skipped & set(before)  # the loader never yields a skipped id
    assert set(before) == set(ids) - skipped

    # Rewrite every reason but the ablation: it stays a (carried-over) skip list.
    logged: list[str] = []
    report = rewrite_without_skipped(inputs_for(root, "web"), root, "web",
                                     reasons=["dedup", "nsfw"], options=options,
                                     log=logged.append)
    assert report.excluded == len(reasons["dedup"] | reasons["nsfw"])
    groups = [m for m in logged if " group(s) of at most " in m]
    assert groups and ("in 1 group(s)" in groups[0]) == (plan_rows is None), groups
    carried = reasons["no_blue"] - reasons["dedup"] - reasons["nsfw"]
    assert report.carried_over.skipped_total == len(carried)
    assert report.tree.left_out["excluded"] == report.excluded
    assert set(_loader_ids(root)) == set(before)
    tree = trees.current_tree(root, "web")
    assert [p.parent.name for p in sidecar_files(tree)]  # only no_blue survives
    assert report.carried_over.skipped_per_reason.keys() == {"no_blue"}

    # By default the opt-in ablation list stays a skip list; named, its samples leave too.
    report = rewrite_without_skipped(inputs_for(root, "web"), root, "web", options=options)
    assert report.rewritten_reasons == [] and report.excluded == 0
    assert report.carried_over.skipped_per_reason.keys() == {"no_blue"}
    report = rewrite_without_skipped(inputs_for(root, "web"), root, "web",
                                     reasons=["no_blue"], options=options)
    assert set(_loader_ids(root)) == set(before)
    assert sidecar_files(trees.current_tree(root, "web")) == []  # skip lists now empty
    left = set(mapping.to_table(columns=["id"]).column("id").to_pylist())
    assert left == set(before)
