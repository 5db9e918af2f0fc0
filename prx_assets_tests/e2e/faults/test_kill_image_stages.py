"""Faults in the image stages: runs killed mid-ingest (between two chunk commits) and
mid-image-stage (after a committed chunk), and a Ray worker killed inside an image task.

How every fault test here runs: the package docstring (faults/__init__.py).
"""

from __future__ import annotations

import os
import signal

import pytest

from prx_assets.testing.fault_corpus import (
    NEW_FINGERPRINT,
    NEW_SETTINGS,
    assert_exact,
    assert_source_complete,
    failure,
    ids,
    image_run,
    kill_mid_stage,
    materialization_meta,
    start_run,
)
from prx_assets.testing.fault_runs import (
    process_title,
    run_in_process,
    store_state,
    table_state,
)

pytestmark = pytest.mark.e2e  # whole-graph runs and runs in subprocesses


def _without(rows: list[dict], column: str) -> list[dict]:
    return sorted(({k: v for k, v in r.items() if k != column} for r in rows),
                  key=lambda r: r["id"])


def test_kill_during_ingest(corpus, tmp_path):
    """Every file of the source touched (same bytes, a later mtime), so the run reads them
    all again; killed right after its first chunk commit, it leaves a readable table with
    every id once, and the rerun reads only the units not committed."""
    before = store_state(corpus.data_root, ["web"])
    files = sorted(corpus.folders["web"].glob("*.jpg"))
    for path in files:
        stat = path.stat()
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    config = {"ops": {"raw_images": {"config": {"chunk_rows": 4, "files_per_task": 4}}}}
    spec = corpus.spec("source_job", "web", ["raw_images"])
    spec.run_config = config
    kill_mid_stage(corpus, spec, "raw_images", "ingest.chunk_committed", tmp_path)
    killed = table_state(corpus.uri("raw_images", "web"))
    assert_exact(ids(corpus.uri("raw_images", "web")), corpus.ids("web"))
    assert _without(killed["rows"], "unit_signature") == \
        _without(before["raw_images/web"]["rows"], "unit_signature")  # same content
    others = {k: v for k, v in store_state(corpus.data_root, ["web"]).items()
              if k != "raw_images/web"}
    assert others == {k: v for k, v in before.items() if k != "raw_images/web"}

    result = run_in_process(corpus.defs, "source_job", "web", corpus.instance, ["raw_images"],
                            run_config=config)
    assert result.success, failure(result)
    meta = materialization_meta(result)
    assert 0 < meta["rows_processed"] < len(files)  # only what the killed run had not committed
    assert meta["rows_processed"] + meta["rows_reused"] == len(files)
    assert_exact(ids(corpus.uri("raw_images", "web")), corpus.ids("web"))
    after = table_state(corpus.uri("raw_images", "web"))
    assert after["version"] > before["raw_images/web"]["version"]
    assert _without(after["rows"], "unit_signature") == \
        _without(before["raw_images/web"]["rows"], "unit_signature")  # same inputs, same rows


def test_kill_during_image_stage(corpus, tmp_path):
    """A settings change (every row to redo) committed four rows at a time, killed right
    after its first chunk: the chunk is kept, the rerun does only the rest and equals a
    full run under those settings; a full redo under the old settings gives back the old
    bytes."""
    assets = ["bucketed_images", "phashes"]
    before = store_state(corpus.data_root, ["web"])
    bucketed = corpus.uri("bucketed_images", "web")
    spec = corpus.spec("source_job", "web", assets)
    spec.run_config = NEW_SETTINGS
    kill_mid_stage(corpus, spec, "image_stage", "images.chunk_committed", tmp_path)
    outage = table_state(bucketed)
    assert outage["version"] > before["bucketed_images/web"]["version"]
    assert_exact([r["id"] for r in outage["rows"]], corpus.ids("web"))  # none lost, none doubled
    redone = [r["id"] for r in outage["rows"] if r["settings"] == NEW_FINGERPRINT]
    assert len(redone) == 4, "not killed after exactly one chunk"

    meta = image_run(corpus, NEW_SETTINGS)
    assert (meta["rows_processed"].value, meta["rows_reused"].value) == \
        (len(corpus.ids("web")) - 4, 4)
    resumed = store_state(corpus.data_root, ["web"])
    assert {r["settings"] for r in resumed["bucketed_images/web"]["rows"]} == {NEW_FINGERPRINT}
    assert_source_complete(corpus, "web")

    assert image_run(corpus)["rows_processed"].value == len(corpus.ids("web"))
    for name in assets:  # the old settings again: the old bytes
        assert table_state(corpus.uri(name, "web"))["rows"] == before[f"{name}/web"]["rows"]
    image_run(corpus, NEW_SETTINGS)  # a full run under the new settings: what resuming made
    for name in assets:
        assert table_state(corpus.uri(name, "web"))["rows"] == resumed[f"{name}/web"]["rows"]
    image_run(corpus)  # leave the store as the other tests expect it


def test_ray_worker_killed_mid_task(corpus, tmp_path):
    """SIGKILL the Ray worker held inside the image stage's task: Ray Data retries the task,
    the retry passes the failpoint (it fires once per run), and the run commits exactly the
    expected rows. (New settings, so that every row has to be redone.)"""
    spec = corpus.spec("source_job", "web", ["bucketed_images", "phashes"])
    spec.run_config = NEW_SETTINGS
    run, held = start_run(corpus, spec, tmp_path, "images.bucket_batch")
    killed: list[str] = []
    try:
        title = process_title(held["pid"])
        assert held["pid"] != run.process.pid and title.startswith("ray::"), title
        os.kill(held["pid"], signal.SIGKILL)
        killed.append(title)
        result = run.wait(timeout=600)
    finally:
        if run.alive():
            run.kill()
    assert result["success"], run.output()[-6000:]
    assert killed and "bucket_batch" in killed[0], "no worker was caught mid-task"
    assert_source_complete(corpus, "web")
    rows = table_state(corpus.uri("bucketed_images", "web"))["rows"]
    assert {r["settings"] for r in rows} == {NEW_FINGERPRINT}
    image_run(corpus)  # back to the default settings
