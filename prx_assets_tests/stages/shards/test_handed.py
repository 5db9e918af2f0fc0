"""mds_shards handed its inputs' changes: after a tree, a run compares only the ids its
inputs wrote or deleted since (the record in the tree's manifest), and leaves the same
tree a run comparing every id would: the mapping holds exactly the planned samples with
their fingerprints. A compaction of an input, or a rewrite's tree, means a full compare."""

import dataclasses
from datetime import UTC, datetime

import pyarrow as pa

from prx_assets.stages.captions.captions import CAPTIONS_SCHEMA
from prx_assets.stages.ingest.raw_rows import RAW_IMAGES_SCHEMA
from prx_assets.stages.shards import mds, plan, verify
from prx_assets.stages.shards.handed import consumed_inputs
from prx_assets.storage import trees
from prx_assets.storage.filters import in_filter
from prx_assets.storage.key_index import KeyIndexPolicy, key_index_stats
from prx_assets.storage.lance_tables import append_rows
from prx_assets.storage.layout import Storage
from prx_assets.storage.tables import RAW_IMAGES
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


def mapped(data_root) -> dict[str, int]:
    rows = Storage(data_root).table("mds_samples", "web").to_table(columns=["id", "fingerprint"])
    return dict(zip(rows["id"].to_pylist(), rows["fingerprint"].to_pylist(), strict=True))


def planned(data_root) -> tuple[dict[str, int], dict]:
    """What a run comparing every id plans: the samples the tree must hold."""
    rows, left_out = plan.plan_samples(inputs_for(data_root, "web").pinned())
    return (dict(zip(rows["id"].to_pylist(), rows["fingerprint"].to_pylist(), strict=True)),
            dict(left_out))


def write(data_root) -> mds.TreeReport:
    return mds.write_mds_tree(inputs_for(data_root, "web"), data_root, "web", OPTIONS)


def assert_tree_matches_inputs(data_root, report) -> None:
    samples, left_out = planned(data_root)
    assert mapped(data_root) == samples
    assert dict(report.left_out) == left_out
    assert report.samples == len(samples)
    checks, problems = verify.verify_tree(data_root, "web")
    assert all(c.ok for c in checks) and not problems, (checks, problems)


def test_a_run_compares_only_the_ids_its_inputs_wrote_since_the_tree(data_root):
    corpus = build_corpus(data_root, "web", per_shape=4)
    first = write(data_root)
    assert first.compared_ids is None  # no tree before: every id
    manifest = trees.tree_store(Storage(data_root), "web").manifest(first.tree_version)
    assert set(manifest["consumed"]) == {"bucketed_images", "captions"}

    add_sample(data_root, NEW_ID)
    gone = sorted(corpus["images"])[0]
    remove_sample(data_root, gone)
    second = write(data_root)
    assert second.compared_ids == 2 and second.appended
    assert (second.processed, second.removed) == (1, 1)
    assert second.reused == len(corpus["images"]) - 1
    assert_tree_matches_inputs(data_root, second)

    again = write(data_root)  # the new tree recorded the inputs it consumed: nothing handed
    assert again.compared_ids == 0 and not again.changed
    assert again.tree_version == second.tree_version


def test_recaptioned_and_rejected_samples_handed_leave_the_tree_a_full_compare_would(
        data_root):
    corpus = build_corpus(data_root, "web", per_shape=4)
    write(data_root)
    recaptioned, rejected = sorted(corpus["images"])[1:3]
    storage = Storage(data_root)
    captions = storage.table("captions", "web")
    captions.open().delete(f"id = '{recaptioned}' AND caption_version = '{ACTIVE}'")
    append_rows(captions, pa.Table.from_pylist(
        [_caption(recaptioned, ACTIVE, "a new caption", "ok", datetime(2026, 3, 1, tzinfo=UTC))],
        schema=CAPTIONS_SCHEMA), CAPTIONS_SCHEMA)
    storage.table("bucketed_images", "web").open().update({"status": "'rejected'"},
                                                           where=f"id = '{rejected}'")
    report = write(data_root)
    assert report.compared_ids == 2
    assert (report.processed, report.removed) == (1, 2)
    assert rejected not in mapped(data_root)
    assert_tree_matches_inputs(data_root, report)


def test_after_a_compaction_of_an_input_every_id_is_compared(data_root):
    corpus = build_corpus(data_root, "web", per_shape=4)
    write(data_root)
    remove_sample(data_root, sorted(corpus["images"])[0])
    add_sample(data_root, NEW_ID)
    bucketed = Storage(data_root).table("bucketed_images", "web").open()
    bucketed.optimize.compact_files(target_rows_per_fragment=1 << 20)  # consumed fragments gone
    report = write(data_root)
    assert report.compared_ids is None
    assert (report.processed, report.removed) == (1, 1)
    assert_tree_matches_inputs(data_root, report)


def test_after_a_tree_leaving_samples_out_every_id_is_compared(data_root):
    corpus = build_corpus(data_root, "web", per_shape=2)
    inputs = inputs_for(data_root, "web")
    left_out = sorted(corpus["images"])[:1]
    excluding = plan.SampleInputs(inputs.bucketed, inputs.captions, inputs.caption_filter,
                                  exclude_ids=pa.array(left_out))
    assert consumed_inputs(excluding) is None  # as a rewrite builds: no record
    mds.write_mds_tree(excluding, data_root, "web", plan.WriteOptions(
        size_limit=60_000, rows_per_part=7, parallel=False, incremental=False))
    assert left_out[0] not in mapped(data_root)
    report = write(data_root)
    assert report.compared_ids is None
    assert_tree_matches_inputs(data_root, report)


def test_the_mapping_keeps_a_key_index_the_handed_lookups_use(data_root):
    corpus = build_corpus(data_root, "web", per_shape=3)
    options = plan.WriteOptions(size_limit=60_000, rows_per_part=7, parallel=False,
                                mapping_index=KeyIndexPolicy(min_rows=1))
    inputs = inputs_for(data_root, "web")
    first = mds.write_mds_tree(inputs, data_root, "web", options)
    mapping = Storage(data_root).table("mds_samples", "web")
    stats = key_index_stats(mapping.open(), "id")
    assert stats is not None and stats["num_unindexed_rows"] == 0
    assert first.mapping_version == mapping.latest_version()  # the indexed version

    add_sample(data_root, NEW_ID)
    remove_sample(data_root, sorted(corpus["images"])[0])
    second = mds.write_mds_tree(inputs, data_root, "web", options)
    assert second.compared_ids == 2 and (second.processed, second.removed) == (1, 1)
    stats = key_index_stats(mapping.latest().open(), "id")
    assert stats is not None and stats["num_unindexed_rows"] == 0  # the merged row indexed
    plan_ = mapping.latest().open().scanner(filter=f"id = '{NEW_ID}'").explain_plan()
    assert "ScalarIndexQuery" in plan_ or "MaterializeIndex" in plan_, plan_
    assert_tree_matches_inputs(data_root, second)
    again = mds.write_mds_tree(inputs, data_root, "web", options)
    assert not again.changed and again.mapping_version == second.mapping_version


def test_a_deleted_caption_of_an_id_with_other_versions_is_handed(data_root):
    corpus = build_corpus(data_root, "web", per_shape=4)  # every id has an older version too
    write(data_root)
    uncaptioned = sorted(corpus["images"])[1]
    captions = Storage(data_root).table("captions", "web")
    captions.open().delete(f"id = '{uncaptioned}' AND caption_version = '{ACTIVE}'")
    report = write(data_root)
    assert report.compared_ids == 1 and report.removed == 1
    assert uncaptioned not in mapped(data_root)
    assert_tree_matches_inputs(data_root, report)


def test_a_run_that_finds_nothing_to_change_is_not_handed_the_same_changes_again(data_root):
    corpus = build_corpus(data_root, "web", per_shape=4)
    first = write(data_root)
    other_version = sorted(corpus["images"])[0]  # a caption no sample of the tree uses
    append_rows(Storage(data_root).table("captions", "web"), pa.Table.from_pylist(
        [_caption(other_version, "v-other", "another captioner's words", "ok",
                  datetime(2026, 3, 1, tzinfo=UTC))], schema=CAPTIONS_SCHEMA), CAPTIONS_SCHEMA)
    nothing = write(data_root)
    assert nothing.compared_ids == 1 and not nothing.changed
    assert nothing.tree_version == first.tree_version

    again = write(data_root)  # the run that found nothing recorded what it consumed
    assert again.compared_ids == 0 and not again.changed

    add_sample(data_root, NEW_ID)  # a new tree: the record of the old one no longer applies
    grown = write(data_root)
    assert grown.compared_ids == 1 and grown.changed
    assert_tree_matches_inputs(data_root, grown)
    assert write(data_root).compared_ids == 0


def _write_provenance(data_root, provenance: dict[str, dict]) -> None:
    """raw_images rows with the ids' provenance, replacing their rows before (as ingest
    does: delete, then append)."""
    table = Storage(str(data_root)).table(RAW_IMAGES, "web")
    if table.exists():
        table.open().delete(in_filter("id", list(provenance)))
    rows = [{"id": sample_id, "source": "web", "source_key": sample_id, "status": "ok", **p}
            for sample_id, p in provenance.items()]
    append_rows(table, pa.Table.from_pylist(rows, schema=RAW_IMAGES_SCHEMA), RAW_IMAGES_SCHEMA)


def _with_raw(data_root) -> plan.SampleInputs:
    return dataclasses.replace(inputs_for(data_root, "web"), license="cc0",
                               raw=Storage(str(data_root)).table(RAW_IMAGES, "web"))


def test_a_change_of_provenance_alone_is_handed_and_rewrites_the_sample(data_root):
    ids = sorted(build_corpus(data_root, "web", per_shape=2)["images"])
    _write_provenance(data_root, {i: {"license": "cc-by-4.0", "attribution": "A. Maker"}
                                  for i in ids})
    mds.write_mds_tree(_with_raw(data_root), data_root, "web", OPTIONS)
    before = mapped(data_root)

    _write_provenance(data_root, {ids[0]: {"license": "cc-by-4.0", "attribution": "B. Maker"}})
    report = mds.write_mds_tree(_with_raw(data_root), data_root, "web", OPTIONS)
    assert report.compared_ids == 1 and report.processed == 1 and report.changed
    after = mapped(data_root)
    assert after[ids[0]] != before[ids[0]]
    assert {i: after[i] for i in ids[1:]} == {i: before[i] for i in ids[1:]}
    full, _ = plan.plan_samples(_with_raw(data_root).pinned())  # a full compare agrees
    assert dict(zip(full["id"].to_pylist(), full["fingerprint"].to_pylist(),
                    strict=True)) == after


def test_a_sample_without_provenance_of_its_own_keeps_its_fingerprint(data_root):
    ids = sorted(build_corpus(data_root, "web", per_shape=1)["images"])
    without, _ = plan.plan_samples(inputs_for(data_root, "web").pinned())
    # The source's license, nothing else: what the sample carried before provenance counted.
    _write_provenance(data_root, {i: {"license": "cc0"} for i in ids})
    default, _ = plan.plan_samples(_with_raw(data_root).pinned())
    assert default["fingerprint"].to_pylist() == without["fingerprint"].to_pylist()
    _write_provenance(data_root, {ids[0]: {"license": "cc0", "url": "https://a.example/1"}})
    changed, _ = plan.plan_samples(_with_raw(data_root).pinned())
    differs = [a != b for a, b in zip(changed["fingerprint"].to_pylist(),
                                      without["fingerprint"].to_pylist(), strict=True)]
    assert sum(differs) == 1 and changed["id"][differs.index(True)].as_py() == ids[0]
