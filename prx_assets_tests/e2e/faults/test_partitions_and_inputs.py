"""Faults around runs: a write that cannot happen, two partitions at once (two processes,
each with its own embedded Ray, one instance), and inputs changing between runs.

How every fault test here runs: the package docstring (faults/__init__.py).
"""

from __future__ import annotations

import pytest

from prx_assets.stages.ingest.ids import sample_id
from prx_assets.storage.trees import current_tree
from prx_assets.testing.fault_corpus import (
    RAY_START_TIMEOUT,
    STAGE_ASSETS,
    assert_source_complete,
    failure,
)
from prx_assets.testing.fault_runs import (
    RunProcess,
    materialized_in_run,
    run_in_process,
    store_state,
    table_state,
)
from prx_assets.testing.images import jpeg_bytes

pytestmark = pytest.mark.e2e  # whole-graph runs and runs in subprocesses


def test_unwritable_output_fails_clearly(corpus):
    """A regular file where a folder must be created: the partition fails with a message
    naming the path and the cause; nothing stored before is touched."""
    before = store_state(corpus.data_root, ["web"])
    blocker = corpus.data_root / "lance" / "bucketed_images" / "alt.lance"
    corpus.run("source_job", "alt", ["raw_images"])
    raw_alt = table_state(corpus.uri("raw_images", "alt"))
    blocker.write_text("not a table")
    try:
        result = run_in_process(corpus.defs, "source_job", "alt", corpus.instance,
                                ["bucketed_images", "phashes"])
        assert not result.success
        message = failure(result)
        assert str(blocker) in message and "not a folder" in message, message
        assert store_state(corpus.data_root, ["web"]) == before
        assert table_state(corpus.uri("raw_images", "alt")) == raw_alt
        assert blocker.read_text() == "not a table"
    finally:
        blocker.unlink()


def test_two_partitions_at_once(corpus, tmp_path):
    """Two runs, two sources, two processes with their own embedded Ray, one instance."""
    before = store_state(corpus.data_root, ["web"])
    runs = [RunProcess(corpus.spec("source_job", source, STAGE_ASSETS), tmp_path)
            for source in ("alt", "more")]
    results = [run.wait(timeout=600) for run in runs]
    for i, (run, result) in enumerate(zip(runs, results, strict=True)):
        if not result["success"] and RAY_START_TIMEOUT in run.output():  # see start_run
            runs[i] = RunProcess(corpus.spec("source_job", run.spec.partition, STAGE_ASSETS),
                                 tmp_path)
            result = results[i] = runs[i].wait(timeout=600)
        assert result["success"], runs[i].output()[-6000:]
    for source in ("alt", "more"):
        assert_source_complete(corpus, source)
        assert materialized_in_run(corpus.instance, runs[0 if source == "alt" else 1]
                                   .spec.run_id) >= {"raw_images", "mds_shards"}
    assert store_state(corpus.data_root, ["web"]) == before


def test_inputs_changing_between_runs(corpus):
    """Files added, removed and modified in a folder source: the rerun reflects exactly the
    new state in every table, the captions downstream sees and the MDS tree."""
    source, folder = "alt", corpus.folders["alt"]
    if not corpus.uri("mds_samples", source).exists():
        corpus.run("source_job", source, STAGE_ASSETS)
    old_raw = {r["source_key"]: r for r in table_state(corpus.uri("raw_images", source))["rows"]}
    # added
    (folder / "a_new.jpg").write_bytes(jpeg_bytes(720, 540, 555))
    (folder / "a_new.txt").write_text("a new photo")
    # removed (with its caption)
    (folder / "a01.jpg").unlink()
    (folder / "a01.txt").unlink()
    # modified: new pixels and size, new caption; and the small one grows past the filter
    (folder / "a02.jpg").write_bytes(jpeg_bytes(900, 600, 777))
    (folder / "a02.txt").write_text("a02 replaced by a wide photo")
    (folder / "asmall.jpg").write_bytes(jpeg_bytes(640, 480, 778))
    (folder / "asmall.txt").write_text("the small one, now big enough")

    corpus.run("source_job", source, STAGE_ASSETS)
    assert_source_complete(corpus, source)  # exact id sets, from the files now present
    raw = {r["source_key"]: r for r in table_state(corpus.uri("raw_images", source))["rows"]}
    assert set(raw) == set(corpus.files(source))
    assert raw["a02.jpg"]["width"] == 900 and raw["a02.jpg"]["image"] != old_raw["a02.jpg"]["image"]
    assert raw["a03.jpg"] == old_raw["a03.jpg"]  # unchanged file, unchanged row
    # What the trainer reads: one sample per current file, with its current caption. The
    # rerun appended the new and changed files as new shards; their old copies and the
    # removed file stay in older shards, skipped as `stale` (applied whatever the reasons).
    from streaming import Stream

    from prx_assets.engine.shm_prefix import claiming_prefix
    from prx_assets.loader.dataset import SkipListStreamingDataset

    tree = current_tree(corpus.data_root, source)
    streams = [Stream(local=str(p.parent)) for p in sorted(tree.glob("*/*/index.json"))]
    dataset = claiming_prefix(lambda: SkipListStreamingDataset(
        streams=streams, batch_size=1, skip_reasons=(), shuffle=False, decode_images=False))
    samples = {sample["id"]: sample for sample in dataset}
    assert sample_id(source, "asmall.jpg") in corpus.kept(source)
    assert set(samples) == corpus.kept(source)
    for name in corpus.files(source):
        caption = (folder / name).with_suffix(".txt").read_text().strip()
        assert samples[sample_id(source, name)]["caption"] == caption, name
    assert samples[sample_id(source, "a02.jpg")]["original_width"] == 900
