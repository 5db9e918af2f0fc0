"""A full build planned in groups of leaves: leaves packed up to `plan_rows` kept rows, a
bigger leaf cut into ranges of ids; the tree holds the same samples in the same order as a
whole-source plan, every stored sample where the mapping says, the counts exact; the same
options give the same bytes; a kill before the mapping commit leaves the previous tree
and mapping, and the rerun no duplicates. An incremental run comparing every id compares
group by group and finds the delta a whole-source comparison finds."""

import dataclasses
import gc
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pytest

from prx_assets.stages.captions.captions import CAPTIONS_SCHEMA
from prx_assets.stages.shards import groups, mds, plan, verify
from prx_assets.stages.shards.mapping import mapping_for_append
from prx_assets.storage import trees
from prx_assets.storage.lance_tables import append_rows
from prx_assets.storage.layout import Storage
from prx_assets.testing.mds_corpus import (
    ACTIVE,
    NEW_ID,
    _caption,
    add_sample,
    build_corpus,
    inputs_for,
)
from prx_assets.testing.shared_memory import plain_dataset, release_shared_memory
from prx_assets.testing.tree_writers import kill_held_at

WHOLE = plan.WriteOptions(size_limit=60_000, rows_per_part=7, parallel=False,
                          incremental=False, plan_rows=10**9)
GROUPED = dataclasses.replace(WHOLE, plan_rows=5)  # leaves of 6-8 rows: packed and cut
APPENDING = dataclasses.replace(GROUPED, incremental=True)


def write(data_root: Path, options: plan.WriteOptions) -> mds.TreeReport:
    return mds.write_mds_tree(inputs_for(data_root, "web"), data_root, "web", options)


def stored_ids(tree: Path) -> dict[str, list[str]]:
    """Each leaf's samples as a plain StreamingDataset reads them, in order."""
    found = {}
    for leaf in trees.tree_leaves(tree):
        release_shared_memory(tree)
        dataset = plain_dataset(local=str(leaf), shuffle=False, batch_size=1)
        found[str(leaf.relative_to(tree))] = [dataset[i]["id"] for i in range(len(dataset))]
        del dataset
        gc.collect()
    release_shared_memory(tree)
    return found


def mapping_rows(data_root: Path) -> dict[str, tuple]:
    rows = Storage(data_root).table("mds_samples", "web").to_table().to_pylist()
    return {r["id"]: (r["leaf"], r["fingerprint"]) for r in rows}


def test_groups_pack_leaves_and_cut_a_bigger_one_into_id_ranges(data_root):
    build_corpus(data_root, "web", per_shape=6, uncaptioned=0, rejected=0)
    inputs = inputs_for(data_root, "web").pinned()
    counts = groups.kept_per_leaf(inputs)
    assert list(counts) == sorted(counts) and set(counts.values()) == {6}
    cut = groups.plan_groups(inputs, counts, plan_rows=4)
    assert all(len(g.leaves) == 1 for g in cut)  # 6 > 4: every leaf cut in two ranges
    assert [(g.low is None, g.high is None) for g in cut[:2]] == [(True, False), (False, True)]
    assert cut[0].high == cut[1].low
    packed = groups.plan_groups(inputs, counts, plan_rows=12)
    assert [len(g.leaves) for g in packed] == [2, 2]
    assert packed[0].where(whole_source=False).count("tier =") == 2
    whole = groups.plan_groups(inputs, counts, plan_rows=10**9)
    assert len(whole) == 1 and whole[0].where(whole_source=True) is None


def test_a_grouped_build_holds_what_a_whole_plan_holds(data_root):
    build_corpus(data_root, "web", per_shape=7)
    whole = write(data_root, WHOLE)
    whole_ids, whole_mapping = stored_ids(whole.path), mapping_rows(data_root)
    grouped = write(data_root, GROUPED)
    assert grouped.tree_version != whole.tree_version
    assert stored_ids(grouped.path) == whole_ids  # the same samples, leaf by leaf, in order
    assert mapping_rows(data_root) == whole_mapping
    assert (grouped.samples, dict(grouped.left_out)) == (whole.samples, dict(whole.left_out))
    assert (grouped.processed, grouped.removed) == (whole.samples, 0)
    checks, problems = verify.verify_tree(data_root, "web")  # every sample where mapped
    assert all(c.ok for c in checks) and not problems, (checks, problems)


def test_a_grouped_build_counts_the_samples_gone(data_root):
    corpus = build_corpus(data_root, "web", per_shape=7)
    write(data_root, GROUPED)
    gone = sorted(corpus["images"])[:3]
    bucketed = Storage(data_root).table("bucketed_images", "web").open()
    bucketed.delete(" OR ".join(f"id = '{i}'" for i in gone))
    again = write(data_root, GROUPED)
    assert again.removed == 3 and again.processed == again.samples
    assert not set(gone) & set(mapping_rows(data_root))


def test_the_same_options_give_the_same_bytes(data_root):
    build_corpus(data_root, "web", per_shape=7)
    first, second = write(data_root, GROUPED), write(data_root, GROUPED)
    files = sorted(p.relative_to(first.path) for p in first.path.rglob("shard.*.mds"))
    assert files and files == sorted(p.relative_to(second.path)
                                     for p in second.path.rglob("shard.*.mds"))
    for rel in files:
        assert (first.path / rel).read_bytes() == (second.path / rel).read_bytes(), rel


_FULL_BUILD = """
import sys
from pathlib import Path
from prx_assets.stages.shards import mds, plan
from prx_assets.testing.mds_corpus import inputs_for
root = Path(sys.argv[1])
mds.write_mds_tree(inputs_for(root, "web"), root, "web", plan.WriteOptions(
    size_limit=60_000, rows_per_part=7, parallel=False, incremental=False, plan_rows=5))
"""


@pytest.mark.e2e  # a build in a subprocess, killed
def test_a_kill_before_the_mapping_commit_keeps_the_previous_tree(data_root, tmp_path):
    build_corpus(data_root, "web", per_shape=7)
    first = write(data_root, GROUPED)
    mapping = Storage(data_root).table("mds_samples", "web")
    version, before = mapping.latest_version(), mapping_rows(data_root)

    kill_held_at(_FULL_BUILD, [str(data_root)], "mds.before_mapping_commit",
                 tmp_path / "marker.json")
    assert trees.current_tree(data_root, "web") == first.path
    assert mapping.latest_version() == version and mapping_rows(data_root) == before
    referenced = {d.path for f in mapping.open().get_fragments() for d in f.data_files()}
    staged = {p.name for p in (Path(mapping.uri) / "data").iterdir()}
    assert staged - referenced  # the killed build's fragments: written, in no version
    checks, problems = verify.verify_tree(data_root, "web")  # the previous tree reads whole
    assert all(c.ok for c in checks) and not problems, (checks, problems)

    rerun = write(data_root, GROUPED)  # the killed run's staged fragments are no version's
    rows = Storage(data_root).table("mds_samples", "web").to_table(columns=["id"])["id"]
    assert len(rows) == len(set(rows.to_pylist())) == rerun.samples == first.samples
    checks, problems = verify.verify_tree(data_root, "web")
    assert all(c.ok for c in checks) and not problems, (checks, problems)


def change_inputs(data_root: Path, corpus: dict) -> dict[str, str]:
    """A new sample, a removed one, a re-captioned one, one moved to another leaf, and a
    leaf whose samples all left; returns which ids."""
    ids = sorted(i for i in corpus["images"] if i.startswith("web:1-64x64"))
    changed = {"removed": ids[0], "recaptioned": ids[1], "moved": ids[2]}
    add_sample(data_root, NEW_ID)
    storage = Storage(data_root)
    bucketed, captions = (storage.table(t, "web") for t in ("bucketed_images", "captions"))
    bucketed.open().delete(f"id = '{changed['removed']}' OR id LIKE 'web:2-96x96-%'")
    bucketed.open().update({"width": "48", "height": "80"}, where=f"id = '{changed['moved']}'")
    captions.open().delete(f"id = '{changed['recaptioned']}' AND caption_version = '{ACTIVE}'")
    append_rows(captions, pa.Table.from_pylist(
        [_caption(changed["recaptioned"], ACTIVE, "a new caption", "ok",
                  datetime(2026, 3, 1, tzinfo=UTC))], schema=CAPTIONS_SCHEMA), CAPTIONS_SCHEMA)
    return changed


def test_a_compare_in_groups_finds_the_delta_a_whole_compare_finds(data_root):
    corpus = build_corpus(data_root, "web", per_shape=7)
    write(data_root, GROUPED)
    changed = change_inputs(data_root, corpus)
    storage = Storage(data_root)
    inputs, mapping = inputs_for(data_root, "web").pinned(), storage.table("mds_samples", "web")
    planned, left_out = plan.plan_samples(inputs)
    whole = plan.plan_delta(planned, mapping_for_append(mapping))
    build = plan.Build(trees.tree_store(storage, "web"), mapping, inputs, APPENDING,
                       mapping.latest_version())
    grouped, grouped_left_out = groups.compare_groups(build)
    assert grouped.write.to_pylist() == whole.write.to_pylist()  # the same rows, in order
    assert grouped.stale.sort_by("id").to_pylist() == whole.stale.sort_by("id").to_pylist()
    assert grouped.removed_ids == whole.removed_ids
    assert (grouped.reused, dict(grouped_left_out)) == (whole.reused, dict(left_out))
    written = set(grouped.write["id"].to_pylist())
    assert {NEW_ID, changed["recaptioned"], changed["moved"]} <= written
    assert changed["moved"] not in grouped.removed_ids  # moved: superseded, not removed
    assert changed["removed"] in grouped.removed_ids
    assert sum(i.startswith("web:2-96x96") for i in grouped.removed_ids) == 7  # a leaf gone


def test_an_incremental_run_not_handed_its_changes_compares_in_groups(data_root):
    corpus = build_corpus(data_root, "web", per_shape=7)
    first = write(data_root, APPENDING)
    change_inputs(data_root, corpus)
    bucketed = Storage(data_root).table("bucketed_images", "web").open()
    bucketed.optimize.compact_files(target_rows_per_fragment=1 << 20)  # no record usable
    report = write(data_root, APPENDING)
    assert report.compared_ids is None and report.appended
    assert report.tree_version != first.tree_version
    planned, left_out = plan.plan_samples(inputs_for(data_root, "web").pinned())
    rows = mapping_rows(data_root)
    assert {i: fp for i, (_, fp) in rows.items()} == dict(
        zip(planned["id"].to_pylist(), planned["fingerprint"].to_pylist(), strict=True))
    assert dict(report.left_out) == dict(left_out)
    checks, problems = verify.verify_tree(data_root, "web")
    assert all(c.ok for c in checks) and not problems, (checks, problems)



def test_a_lease_lost_after_the_mapping_commit_is_repaired_by_the_next_run(data_root,
                                                                           monkeypatch):
    """The run's lease lapses after its mapping commit, and the writer that took over had
    already removed the run's staged version as unpublished: the mapping names a tree that
    will never be published. Before, the next run appended on top of that mapping and
    nothing repaired it; now it finds the mapping ahead of the tree and builds in full."""
    from prx_assets.stages.shards import publish as publish_module
    from prx_assets.storage.leases import LeaseLostError

    corpus = build_corpus(data_root, "web", per_shape=3)  # small: three builds
    write(data_root, APPENDING)
    change_inputs(data_root, corpus)
    store = trees.tree_store(Storage(data_root), "web")

    def lease_lost_before_the_swap(name: str) -> None:
        if name == "mds.before_publish":
            for version in store.versions():
                if version > (store.current_version() or ""):
                    store.tree(version).delete()  # the taker's remove_unpublished
            raise LeaseLostError("lease lost: expired (test)")

    with monkeypatch.context() as patched:
        patched.setattr(publish_module, "failpoint", lease_lost_before_the_swap)
        with pytest.raises(LeaseLostError):
            write(data_root, APPENDING)
    repaired = write(data_root, APPENDING)
    checks, problems = verify.verify_tree(data_root, "web")
    assert all(c.ok for c in checks) and not problems, (checks, problems)
    assert set(mapping_rows(data_root)) == {i for ids in stored_ids(repaired.path).values()
                                            for i in ids}
