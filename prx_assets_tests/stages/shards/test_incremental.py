"""mds_shards incremental: new samples appended as new shards of a new tree version (old
shards hard-linked), superseded ones skipped as `stale`, nothing new when nothing changed,
and a SIGKILL mid-append (failpoint `mds.write_part`) leaving the previous tree current."""

import dataclasses
import gc
import json
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pytest

from prx_assets.loader import build_dataset
from prx_assets.stages.captions.captions import CAPTIONS_SCHEMA
from prx_assets.stages.shards import mds, plan, verify
from prx_assets.storage import trees
from prx_assets.storage.lance_tables import append_rows
from prx_assets.storage.layout import Storage
from prx_assets.storage.sidecars import REASON_STALE, read_sidecar, sidecar_path
from prx_assets.testing.mds_corpus import (
    ACTIVE,
    NEW_ID,
    _caption,
    add_sample,
    build_corpus,
    inputs_for,
    remove_sample,
)
from prx_assets.testing.mds_corpus import WRITE_OPTIONS as OPTIONS
from prx_assets.testing.shared_memory import plain_dataset, release_shared_memory
from prx_assets.testing.tree_writers import kill_held_at


def shard_inodes(tree: Path) -> dict[str, int]:
    return {str(p.relative_to(tree)): p.stat().st_ino for p in tree.rglob("shard.*.mds")}


def mapping(data_root: Path) -> list[dict]:
    return Storage(data_root).table("mds_samples", "web").to_table().to_pylist()


def test_one_new_and_one_removed_sample_append_one_shard_and_skip_one(data_root):
    corpus = build_corpus(data_root, "web", per_shape=6)
    first = mds.write_mds_tree(inputs_for(data_root, "web"), data_root, "web", OPTIONS)
    old_inodes = shard_inodes(first.path)
    gone = sorted(i for i in corpus["images"] if i.startswith("web:2-96x96"))[0]
    where_gone = next(r for r in mapping(data_root) if r["id"] == gone)
    add_sample(data_root, NEW_ID)
    remove_sample(data_root, gone)

    second = mds.write_mds_tree(inputs_for(data_root, "web"), data_root, "web", OPTIONS)
    assert second.changed and second.appended and second.tree_version != first.tree_version
    assert (second.processed, second.removed) == (1, 1)
    assert second.reused == len(corpus["images"]) - 1
    tree = trees.current_tree(data_root, "web")
    assert tree == second.path
    # Old shards: the same inodes (hard links), none rewritten; exactly one new shard, in the
    # new sample's leaf, numbered after that leaf's old ones.
    new_inodes = shard_inodes(tree)
    assert {k: new_inodes[k] for k in old_inodes} == old_inodes
    added = sorted(set(new_inodes) - set(old_inodes))
    old_in_leaf = sum(k.startswith("1/64x64/") for k in old_inodes)
    assert added == [f"1/64x64/shard.{old_in_leaf:05d}.mds"]
    index = json.loads((tree / "1/64x64/index.json").read_text())["shards"]
    assert [s["raw_data"]["basename"] for s in index][-1] == f"shard.{old_in_leaf:05d}.mds"
    # The removed sample: still stored, skipped as stale; out of the mapping table.
    lists = read_sidecar(sidecar_path(tree / where_gone["leaf"] / where_gone["shard"]))
    assert lists == {REASON_STALE: [where_gone["sample_index"]]}
    rows = {r["id"]: r for r in mapping(data_root)}
    assert gone not in rows and rows[NEW_ID]["shard"] == f"shard.{old_in_leaf:05d}.mds"
    assert set(rows) == (set(corpus["images"]) - {gone}) | {NEW_ID}
    checks, problems = verify.verify_tree(data_root, "web")
    assert all(c.ok for c in checks) and not problems, (checks, problems)

    # A plain StreamingDataset sees every stored sample; the loader skips the stale one.
    stored = 0
    for leaf in trees.tree_leaves(tree):
        dataset = plain_dataset(local=str(leaf), batch_size=1, shuffle=False)
        stored += dataset.num_samples
        del dataset
        release_shared_memory(data_root)
    assert stored == len(corpus["images"]) + 1
    seen = []
    for tier in (1, 2):
        dataset = build_dataset(data_root / "mds", tier, 1, weights={"web": 1.0},
                                skip_reasons=(), shuffle=False)
        seen += [sample["id"] for sample in dataset]
        del dataset
        gc.collect()
        release_shared_memory(data_root)
    assert sorted(seen) == sorted(rows) and gone not in seen


def test_nothing_changed_makes_no_new_tree(data_root):
    build_corpus(data_root, "web", per_shape=3)
    first = mds.write_mds_tree(inputs_for(data_root, "web"), data_root, "web", OPTIONS)
    trees_dir = data_root / "mds/.trees/web"
    versions = sorted(p.name for p in trees_dir.iterdir() if p.is_dir())
    again = mds.write_mds_tree(inputs_for(data_root, "web"), data_root, "web", OPTIONS)
    assert not again.changed and again.tree_version == first.tree_version
    assert (again.processed, again.reused, again.removed) == (0, first.samples, 0)
    assert again.mapping_version == first.mapping_version
    assert sorted(p.name for p in trees_dir.iterdir() if p.is_dir()) == versions


def test_a_changed_sample_is_rewritten_and_its_old_copy_skipped(data_root):
    corpus = build_corpus(data_root, "web", per_shape=4)
    mds.write_mds_tree(inputs_for(data_root, "web"), data_root, "web", OPTIONS)
    changed = sorted(corpus["images"])[0]
    before = next(r for r in mapping(data_root) if r["id"] == changed)
    captions = Storage(data_root).table("captions", "web")
    captions.open().delete(f"id = '{changed}' AND caption_version = '{ACTIVE}'")  # re-captioned:
    recaptioned = _caption(changed, ACTIVE, "a new caption", "ok",  # a new row, created later
                           datetime(2026, 3, 1, tzinfo=UTC))
    append_rows(captions, pa.Table.from_pylist([recaptioned], schema=CAPTIONS_SCHEMA),
                CAPTIONS_SCHEMA)
    report = mds.write_mds_tree(inputs_for(data_root, "web"), data_root, "web", OPTIONS)
    assert (report.processed, report.removed) == (1, 1)
    after = [r for r in mapping(data_root) if r["id"] == changed]
    assert len(after) == 1 and after[0]["shard"] != before["shard"]
    tree = trees.current_tree(data_root, "web")
    assert read_sidecar(sidecar_path(tree / before["leaf"] / before["shard"]))[REASON_STALE] == [
        before["sample_index"]]


def test_other_settings_mean_a_full_build(data_root):
    build_corpus(data_root, "web", per_shape=3)
    mds.write_mds_tree(inputs_for(data_root, "web"), data_root, "web", OPTIONS)
    other = mds.write_mds_tree(inputs_for(data_root, "web"), data_root, "web",
                               plan.WriteOptions(size_limit=90_000, parallel=False))
    assert other.changed and not other.appended and other.processed == other.samples


_APPEND = """
import sys
from pathlib import Path
from prx_assets.stages.shards import mds, plan
from prx_assets.testing.mds_corpus import inputs_for
root = Path(sys.argv[1])
mds.write_mds_tree(inputs_for(root, "web"), root, "web",
                   plan.WriteOptions(size_limit=60_000, rows_per_part=7, parallel=False))
"""


@pytest.mark.e2e  # a build in a subprocess, killed
def test_a_kill_mid_append_leaves_the_previous_tree_and_the_rerun_has_no_duplicates(
        data_root, tmp_path):
    corpus = build_corpus(data_root, "web", per_shape=4)
    first = mds.write_mds_tree(inputs_for(data_root, "web"), data_root, "web", OPTIONS)
    mapping_table = Storage(data_root).table("mds_samples", "web")
    mapping_version = mapping_table.latest_version()
    add_sample(data_root, NEW_ID)

    kill_held_at(_APPEND, [str(data_root)], "mds.write_part", tmp_path / "marker.json")
    assert list((data_root / "mds/.trees/web").glob("*" + trees.PARTIAL_SUFFIX))
    assert trees.current_tree(data_root, "web") == first.path
    assert mapping_table.latest_version() == mapping_version
    checks, problems = verify.verify_tree(data_root, "web")  # the previous tree reads whole
    assert all(c.ok for c in checks) and not problems

    rerun = mds.write_mds_tree(inputs_for(data_root, "web"), data_root, "web", OPTIONS)
    assert rerun.processed == 1 and rerun.reused == len(corpus["images"])
    ids = [r["id"] for r in mapping(data_root)]
    assert len(ids) == len(set(ids)) == len(corpus["images"]) + 1
    assert not list((data_root / "mds/.trees/web").glob("*" + trees.PARTIAL_SUFFIX))
    checks, problems = verify.verify_tree(data_root, "web")
    assert all(c.ok for c in checks) and not problems


def build_killed_before_publish(data_root, monkeypatch, options) -> None:
    """An MDS build killed after its mapping commit, before its tree is published."""
    def killed(self, version, expected):
        raise KeyboardInterrupt("killed before publishing")

    with monkeypatch.context() as patch:
        patch.setattr(trees.TreeStore, "publish", killed)
        with pytest.raises(KeyboardInterrupt):
            mds.write_mds_tree(inputs_for(data_root, "web"), data_root, "web", options)


def test_a_kill_between_mapping_commit_and_publish_is_rolled_forward(data_root, monkeypatch):
    build_corpus(data_root, "web", per_shape=3)
    first = mds.write_mds_tree(inputs_for(data_root, "web"), data_root, "web", OPTIONS)
    add_sample(data_root, NEW_ID)
    build_killed_before_publish(data_root, monkeypatch, OPTIONS)
    assert trees.current_tree(data_root, "web") == first.path  # the mapping is ahead
    rerun = mds.write_mds_tree(inputs_for(data_root, "web"), data_root, "web", OPTIONS)
    assert not rerun.changed  # the interrupted version was published, nothing left to do
    assert trees.current_tree(data_root, "web").name != first.tree_version
    assert NEW_ID in {r["id"] for r in mapping(data_root)}
    checks, problems = verify.verify_tree(data_root, "web")
    assert all(c.ok for c in checks) and not problems


def test_a_rolled_forward_publish_applies_the_retention_it_was_built_with(data_root,
                                                                        monkeypatch):
    """Found by the soak (seed 101, cycle 2: a run SIGKILLed at `mds.before_publish`, rolled
    forward by the next run, which had nothing new to build): the tree the rolled-forward
    version superseded outlived its retention (0 days here) until a later build."""
    options = dataclasses.replace(OPTIONS, retention=timedelta(0))
    build_corpus(data_root, "web", per_shape=2)
    first = mds.write_mds_tree(inputs_for(data_root, "web"), data_root, "web", options)
    add_sample(data_root, NEW_ID)
    build_killed_before_publish(data_root, monkeypatch, options)
    rerun = mds.write_mds_tree(inputs_for(data_root, "web"), data_root, "web", options)
    assert not rerun.changed
    store = trees.source_trees(data_root, "web")
    assert store.versions() == [store.current_version()] != [first.tree_version]


def test_mds_uri_prints_the_resolved_current_tree(data_root, capsys):
    from prx_assets import cli

    assert cli.main(["mds-uri", "web"]) == 2  # no tree yet: a clear error, not a traceback
    assert "materialise mds_shards first" in capsys.readouterr().err
    build_corpus(data_root, "web", per_shape=2)
    report = mds.write_mds_tree(inputs_for(data_root, "web"), data_root, "web", OPTIONS)
    assert cli.main(["mds-uri", "web"]) == 0
    uri = capsys.readouterr().out.strip()
    assert uri == str(report.path) and not os.path.islink(uri)  # resolved: stable under swaps
    dataset = plain_dataset(local=f"{uri}/1/64x64", batch_size=1, shuffle=False)
    assert dataset.num_samples == sum(r["leaf"] == "1/64x64" for r in mapping(data_root))
    del dataset
