"""Faults in the shards and the global tables: runs killed mid-MDS-build (a part of a
`.partial` tree), mid-skip-lists (one sidecar replaced), mid-corpus-replace and mid-dedup
(fragments written, not committed).

How every fault test here runs: the package docstring (faults/__init__.py).
"""

from __future__ import annotations

import shutil

import lance
import pytest

from prx_assets.stages.ingest.ids import sample_id
from prx_assets.stages.skip_lists.skip_lists import skipped_ids
from prx_assets.storage.layout import Storage
from prx_assets.storage.sidecars import read_sidecar, sidecar_files
from prx_assets.storage.tables import MDS_SAMPLES
from prx_assets.storage.trees import PARTIAL_SUFFIX, TREES_DIR, current_tree
from prx_assets.testing.fault_corpus import (
    Corpus,
    assert_source_complete,
    assert_tree_streams,
    kill_mid_stage,
    start_run,
)
from prx_assets.testing.fault_runs import (
    mark_killed_run_failed,
    store_state,
    table_state,
)

pytestmark = pytest.mark.e2e  # whole-graph runs and runs in subprocesses


def test_kill_during_mds_shards(corpus, tmp_path):
    before = store_state(corpus.data_root, ["web"])
    trees = corpus.data_root / "mds" / TREES_DIR / "web"
    spec = corpus.spec("source_job", "web", ["mds_shards"])
    # Nothing changed since the tree was built, so only a full build has work to kill.
    spec.run_config = {"ops": {"mds_shards": {"config": {"incremental": False}}}}
    kill_mid_stage(corpus, spec, "mds_shards", "mds.write_part", tmp_path)
    assert list(trees.glob("*" + PARTIAL_SUFFIX)), "the killed build left its staging"
    # The symlinked tree still resolves to the same whole tree: index.json, shard bytes,
    # sidecars and what StreamingDataset counts, as well as every table, are unchanged.
    assert store_state(corpus.data_root, ["web"]) == before
    assert_tree_streams(corpus, "web", len(corpus.kept("web")))

    # The (incremental) rerun clears the leftovers and finds the current tree up to date.
    corpus.run("source_job", "web", ["mds_shards"])
    assert not list(trees.glob("*" + PARTIAL_SUFFIX))
    assert current_tree(corpus.data_root, "web").name == before["mds/web"]["tree"]
    assert_source_complete(corpus, "web", stream=True)


def test_kill_during_skip_lists(corpus, tmp_path):
    corpus.run("skip_lists_job", "web", ["skip_lists"])  # the current tree has its sidecars
    tree = current_tree(corpus.data_root, "web")
    old_sidecars = {p: read_sidecar(p) for p in sidecar_files(tree)}
    assert old_sidecars  # the copy is a duplicate: a dedup list exists
    # A new ablation list changes what the rerun must write.
    ablated = sorted(corpus.kept("web"))[:3]
    ablations = corpus.data_root / "ablations"
    ablations.mkdir(exist_ok=True)
    (ablations / "faults.txt").write_text("\n".join(ablated) + "\n")
    before = store_state(corpus.data_root, ["web"])
    mapping = Storage(corpus.data_root).table(MDS_SAMPLES, "web")
    dedup = set(skipped_ids(tree, mapping, ["dedup"]).to_pylist())
    assert dedup == {sample_id("web", "wcopy.jpg")} or dedup == {sample_id("web", "w00.jpg")}
    try:
        spec = corpus.spec("skip_lists_job", "web", ["skip_lists"])
        kill_mid_stage(corpus, spec, "skip_lists", "skip_lists.sidecar_written", tmp_path)
        outage = store_state(corpus.data_root, ["web"])
        tables = {k: v for k, v in before.items() if not k.startswith("mds/")}
        assert {k: v for k, v in outage.items() if not k.startswith("mds/")} == tables
        # Each sidecar (parsed by store_state) holds the old lists or the new, never a mix.
        for leaf, shards in outage["mds/web"]["leaves"].items():
            for name, shard in shards.items():
                old = before["mds/web"]["leaves"][leaf][name]
                assert {k: v for k, v in shard.items() if k != "skip"} == \
                    {k: v for k, v in old.items() if k != "skip"}
                assert shard["skip"] == old["skip"] or "faults" in shard["skip"]

        result = corpus.run("skip_lists_job", "web", ["skip_lists"])
        meta = result.asset_materializations_for_node("skip_lists")[0].metadata
        assert meta["skipped_per_reason"].value.records
        assert set(skipped_ids(tree, mapping, ["faults"]).to_pylist()) == set(ablated)
        assert set(skipped_ids(tree, mapping, ["dedup"]).to_pylist()) == dedup
    finally:
        shutil.rmtree(ablations)
        corpus.run("skip_lists_job", "web", ["skip_lists"])


def _corpus_rows(corpus: Corpus) -> tuple[int, list[tuple[str, str]]]:
    table = lance.dataset(str(corpus.data_root / "lance" / "corpus.lance"))
    rows = table.to_table(columns=["id", "source"])
    return table.version, sorted(zip(rows["id"].to_pylist(), rows["source"].to_pylist(),
                                     strict=True))


def test_kill_during_corpus_replace(corpus, tmp_path):
    """A source joining the corpus, killed with its rows written but before its one commit:
    the corpus is exactly as before (no source half in, none doubled); the rerun adds the
    source's rows, each once, and keeps the others."""
    if not corpus.uri("caption_labels", "web").exists():
        corpus.run("source_job", "web", ["caption_labels"])
    corpus.run("corpus_table_job", None)  # "more" has no labels yet: left out
    before_version, before = _corpus_rows(corpus)
    assert before and {source for _, source in before} == {"web"}
    corpus.run("source_job", "more", ["raw_images", "bucketed_images", "phashes", "captions",
                                      "caption_labels"])

    spec = corpus.spec("corpus_table_job", None, ["corpus"])
    kill_mid_stage(corpus, spec, "corpus", "storage.replace_uncommitted", tmp_path)
    assert _corpus_rows(corpus) == (before_version, before)

    corpus.run("corpus_table_job", None)
    _, after = _corpus_rows(corpus)
    corpus_ids = [i for i, _ in after]
    assert len(corpus_ids) == len(set(corpus_ids)), "duplicate ids"
    assert [r for r in after if r[1] == "web"] == before
    more = {i for i, source in after if source == "more"}
    assert more and more <= corpus.kept("more")


def test_kill_during_dedup_and_opt_outs(corpus, tmp_path):
    """dedup_job (the global duplicates and the opt-out audit, each one whole-table write)
    killed with a table's fragments written but not committed: both tables keep the version
    and rows they had; the rerun commits both, the duplicates equal to before (same
    inputs)."""
    tables = {name: corpus.data_root / "lance" / f"{name}.lance"
              for name in ("duplicates", "opt_outs")}
    # Committed over the module's current inputs first: earlier tests may have added a
    # source since the module's own dedup_job.
    corpus.run("dedup_job", None)
    before = {"duplicates": table_state(tables["duplicates"])}
    spec = corpus.spec("dedup_job", None, ["duplicates", "opt_outs"])
    run, _ = start_run(corpus, spec, tmp_path, "storage.overwrite_uncommitted")
    run.kill()
    assert run.process.returncode == -9
    mark_killed_run_failed(corpus.instance, spec.run_id)
    # The asset held had not committed; the other may have, with the same rows (same inputs).
    assert table_state(tables["duplicates"])["rows"] == before["duplicates"]["rows"]
    if tables["opt_outs"].exists():
        table_state(tables["opt_outs"])  # readable

    corpus.run("dedup_job", None)
    assert table_state(tables["duplicates"])["rows"] == before["duplicates"]["rows"]
    assert tables["opt_outs"].exists()
