"""The tree check after an incremental build opens only the leaves whose index changed (none:
no child process), and still fails on a leaf whose index or mapping is wrong."""

import dataclasses
import json
import subprocess
import sys
from datetime import timedelta
from pathlib import PurePath

import pytest

from prx_assets.stages.shards import mds, verify
from prx_assets.storage import trees
from prx_assets.storage.layout import Storage
from prx_assets.storage.leases import LeaseHeldError, tree_lease
from prx_assets.testing.mds_corpus import (
    NEW_ID,
    add_sample,
    build_corpus,
    inputs_for,
    remove_sample,
)
from prx_assets.testing.mds_corpus import WRITE_OPTIONS as OPTIONS


@pytest.fixture
def opened(monkeypatch) -> list[list[str]]:
    """The leaves each StreamingDataset pass opens (the real pass still runs)."""
    calls: list[list[str]] = []
    real = verify.streamed_counts

    def recording(leaves: list[str]) -> list[int]:
        calls.append(["/".join(PurePath(leaf).parts[-2:]) for leaf in leaves])
        return real(leaves)

    monkeypatch.setattr(verify, "streamed_counts", recording)
    return calls


def assert_whole(data_root) -> list[verify.LeafCheck]:
    checks, problems = verify.verify_tree(data_root, "web")
    assert checks and all(c.ok for c in checks) and not problems, (checks, problems)
    return checks


def test_a_check_after_one_new_sample_opens_only_its_leaf(data_root, opened):
    build_corpus(data_root, "web", per_shape=3)
    mds.write_mds_tree(inputs_for(data_root, "web"), data_root, "web", OPTIONS)
    first = assert_whole(data_root)
    assert len(opened) == 1 and len(opened[0]) == len(first)  # a first check opens every leaf

    assert assert_whole(data_root) == first and len(opened) == 1  # nothing changed: no pass

    add_sample(data_root, NEW_ID)  # one sample into leaf 1/64x64
    mds.write_mds_tree(inputs_for(data_root, "web"), data_root, "web", OPTIONS)
    after = assert_whole(data_root)
    assert opened[1:] == [["1/64x64"]]
    grown = {c.leaf: c.streamed for c in after}
    assert grown == {c.leaf: c.streamed + (c.leaf == "1/64x64") for c in first}


def test_a_changed_index_is_opened_again_and_a_wrong_count_fails(data_root, opened):
    build_corpus(data_root, "web", per_shape=3)
    report = mds.write_mds_tree(inputs_for(data_root, "web"), data_root, "web", OPTIONS)
    assert_whole(data_root)
    leaf = trees.tree_leaves(report.path)[0]
    index = json.loads((leaf / trees.INDEX).read_text())
    index["shards"][0]["samples"] += 1  # the index now lists a sample the mapping lacks
    (leaf / trees.INDEX).write_text(json.dumps(index))

    checks, _ = verify.verify_tree(data_root, "web")
    name = str(leaf.relative_to(report.path))
    assert opened[1:] == [[name]]
    assert [c.leaf for c in checks if not c.ok] == [name]


def test_counts_kept_under_another_streaming_release_are_not_trusted(data_root, opened):
    build_corpus(data_root, "web", per_shape=3)
    mds.write_mds_tree(inputs_for(data_root, "web"), data_root, "web", OPTIONS)
    assert_whole(data_root)
    store = trees.tree_store(Storage(data_root), "web")
    saved = json.loads((store.trees_dir / verify.VERIFIED_LEAVES).read_text())
    saved["streaming"] = "0.0.1"
    (store.trees_dir / verify.VERIFIED_LEAVES).write_text(json.dumps(saved))
    assert_whole(data_root)
    assert len(opened) == 2 and opened[1] == opened[0]


def test_the_check_child_gets_streamings_classes_without_transformers():
    code = ("import sys; from prx_assets.stages.shards import stream_counter; "
            "stream, dataset = stream_counter.streaming_dataset_classes(); "
            "print(dataset.__module__, stream.__module__, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["streaming.base.dataset", "streaming.base.stream", "False"]


def test_the_checked_tree_outlives_a_concurrent_build_that_prunes_it(data_root, monkeypatch):
    # Seed 307 of the S3 soak: two runs of one source; the second's check read the tree,
    # then the first run's publish pruned it (retention 0), and its stale samples read as
    # none: "leaf 512/608x432 streamed 7, mapped 4". The check now holds the tree it reads.
    corpus = build_corpus(data_root, "web", per_shape=3)
    mds.write_mds_tree(inputs_for(data_root, "web"), data_root, "web", OPTIONS)
    removed = sorted(i for i in corpus["images"] if i.startswith("web:2-96x96"))[0]
    add_sample(data_root, NEW_ID)
    remove_sample(data_root, removed)  # stored on, skipped as stale in the appended tree
    checked = mds.write_mds_tree(inputs_for(data_root, "web"), data_root, "web", OPTIONS)
    assert checked.appended and checked.removed == 1
    prune_at_once = dataclasses.replace(OPTIONS, retention=timedelta(0))
    real, built = verify.counts_by_index, []

    def another_run_publishes(store, leaves, indexes):  # while the check counts
        add_sample(data_root, "web:1-48x80-9998", shape=(1, 48, 80))
        built.append(mds.write_mds_tree(inputs_for(data_root, "web"), data_root, "web",
                                        prune_at_once))
        assert checked.path.exists()  # held by the check's reader lease
        return real(store, leaves, indexes)

    monkeypatch.setattr(verify, "counts_by_index", another_run_publishes)
    checks, problems = verify.verify_tree(data_root, "web")
    assert built and built[0].tree_version != checked.tree_version
    assert all(c.ok for c in checks) and not problems, (checks, problems)
    assert sum(c.stale for c in checks) == 1
    store = trees.tree_store(Storage(data_root), "web")
    assert checked.tree_version in store.prune(timedelta(0))  # released once checked


def test_the_check_reads_while_no_tree_writer_can_commit(data_root, monkeypatch):
    # A mapping read after another run's commit and a tree read before it disagree: the
    # check takes the tree writers' lease for its reads (here it cannot, and says so).
    build_corpus(data_root, "web", per_shape=3)
    mds.write_mds_tree(inputs_for(data_root, "web"), data_root, "web", OPTIONS)
    monkeypatch.setenv("PRX_LEASE_WAIT_S", "0.2")
    store = trees.tree_store(Storage(data_root), "web")
    with tree_lease(store.data_root, "web"), pytest.raises(LeaseHeldError):
        verify.verify_tree(data_root, "web")
    assert_whole(data_root)  # the lease released: the check reads again
