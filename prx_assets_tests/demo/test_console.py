"""The demo's console lines: short, one per event, the run id shortened, noise said once."""

import os
import warnings
from datetime import datetime

import dagster as dg

from prx_assets.defs.report import WARNINGS_TAG
from prx_assets.demo.console import (
    MAX_WIDTH,
    NATIVE_NOTICES,
    NoticeFilter,
    clip,
    quiet_third_party,
    short_event,
    wrap,
)
from prx_assets.demo.corpus import generate_items
from prx_assets.demo.runner import _run, check_lines, closing_lines
from prx_assets_tests.demo.test_runner import chatty

RUN_ID = "0f1e2d3c-4b5a-6978-8877-665544332211"


def test_an_event_is_one_short_line_with_the_run_id_shortened():
    metadata = {"run_id": RUN_ID, "job_name": "source_job",
                "job_tags": {"dagster/partition": "demo_wds"}, "step_key": "caption_labels",
                "resource_name": None, "dagster_event": None,
                "orig_message": "caption_labels[demo_wds]: 212 of 212 captions " + "x" * 300}
    lines = short_event(metadata, "INFO", datetime(2026, 1, 2, 3, 4, 5))
    assert len(lines) == 1 and len(lines[0]) == MAX_WIDTH and lines[0].endswith("…")
    assert lines[0].startswith("03:04:05 I 0f1e2d3c [demo_wds] caption_labels: caption_labels[")
    assert RUN_ID not in lines[0]


def test_a_failure_keeps_the_end_of_its_traceback_each_line_clipped():
    class Error:
        def to_string(self) -> str:
            return "\n".join([f"  frame {i} " + "y" * 200 for i in range(30)] + ["ValueError: x"])

    class Data:
        error = Error()

    class Event:
        from dagster._core.events import DagsterEventType

        event_type = DagsterEventType.STEP_FAILURE
        event_specific_data = Data()

    metadata = {"run_id": RUN_ID, "job_tags": {}, "step_key": "images",
                "dagster_event": Event(), "orig_message": "Execution of step failed."}
    lines = short_event(metadata, "ERROR", datetime(2026, 1, 2, 3, 4, 5))
    assert lines[0] == "03:04:05 E 0f1e2d3c images: STEP_FAILURE Execution of step failed."
    assert lines[-1] == "    ValueError: x" and len(lines) == 13
    assert all(len(line) <= MAX_WIDTH for line in lines)


def test_a_demo_run_prints_no_line_over_the_width_and_no_full_run_id(capfd):
    instance = dg.DagsterInstance.ephemeral()
    job = dg.Definitions(assets=[chatty]).resolve_implicit_global_asset_job_def()
    result = _run(job, instance)
    assert result.success
    console = capfd.readouterr().err.splitlines()
    mine = [line for line in console if result.run_id[:8] in line]
    assert any("an info line from the asset" in line for line in mine)
    assert all(len(line) <= MAX_WIDTH for line in console)
    assert not any(result.run_id in line for line in console)
    # The run carries the checks that warned (none here) as a tag, as under `make ui`.
    assert instance.get_run_by_id(result.run_id).tags[WARNINGS_TAG] == "none"


def test_summary_lines_wrap_rather_than_lose_words():
    long = "      -> " + " ".join(["word"] * 80)
    wrapped = wrap(long)
    assert all(len(line) <= MAX_WIDTH for line in wrapped) and len(wrapped) == 3
    assert " ".join(w.strip() for w in wrapped).split() == long.split()
    assert wrapped[1].startswith(" " * 9 + "word")
    assert wrap("short") == ["short"] and clip("short") == "short"


def test_the_closing_block_names_make_ui_and_make_browse():
    lines = closing_lines()
    assert any(line.strip().startswith("make ui ") and "127.0.0.1:3000" in line for line in lines)
    assert any(line.strip().startswith("make browse ") and "127.0.0.1:8080" in line
               for line in lines)
    assert all(len(line) <= MAX_WIDTH for line in [*lines, *check_lines([])])


def test_third_party_noise_is_silenced_and_said_once(monkeypatch):
    for name in ("LANCE_LOG", "RAY_AUTH_MODE", "RAY_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        notes = quiet_third_party()
        warnings.warn("lance is not fork-safe. If you are using multiprocessing, use spawn",
                      stacklevel=1)
    assert not caught
    assert os.environ["LANCE_LOG"] == "error" and os.environ["RAY_AUTH_MODE"] == "disabled"
    assert len(notes) == 1 and "token authentication off" in notes[0]
    # A cluster's own settings are left alone.
    monkeypatch.delenv("RAY_AUTH_MODE")
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert quiet_third_party() == [] and "RAY_AUTH_MODE" not in os.environ


def test_building_the_corpus_says_how_far_it_got():
    lines: list[str] = []
    items = generate_items(30, seed=5, prefix="x", progress=lines.append, name="demo_x")
    assert len(items) == 30
    assert lines == ["demo_x: 25 of 30 images drawn", "demo_x: 30 of 30 images drawn"]


RAY_NOTICE = (b"[2026-12-02 15:24:39,123 E 12971 12971] core_worker.cc:2465: Actor with class "
              b"name: 'MapWorker(MapBatches(EmbeddedLabelStage))' and ID: '3820ed8c' has "
              b"constructor arguments in the object store and max_restarts > 0. If the "
              b"arguments in the object store go out of scope or are lost, the actor restart "
              b"will fail. See https://github.com/ray-project/ray/issues/53727 for details.\n")


def test_rays_native_actor_notice_is_said_once_and_other_stderr_lines_pass(capfd):
    with NoticeFilter():
        os.write(2, RAY_NOTICE)
        os.write(2, b"a real error line\n")
        os.write(2, RAY_NOTICE.replace(b"EmbeddedLabelStage", b"VisionEncoder"))
        os.write(2, b"the last line\n")
    err = capfd.readouterr().err.splitlines()
    assert err == [NATIVE_NOTICES[0][1], "a real error line", "the last line"]
    assert all(len(line) <= MAX_WIDTH for line in err)
    os.write(2, RAY_NOTICE)  # after the demo, stderr is the process's own again
    assert "core_worker.cc" in capfd.readouterr().err


RAY_DISK_WARNING = (b"\x1b[33m(raylet)\x1b[0m [2026-12-06 19:23:26,026 E 30760 30771] (raylet) "
                    b"file_system_monitor.cc:116: /tmp/ray/session_2026-12-06_19-23-14_731711_"
                    b"30653 is over 95% full, available space: 12.1898 GB; capacity: 251.972 GB."
                    b" Object creation will fail if spilling is required.\n")


def test_rays_disk_warning_is_said_once_in_short_words_with_its_figures(capfd):
    with NoticeFilter():
        os.write(2, RAY_DISK_WARNING)
        os.write(2, RAY_DISK_WARNING.replace(b"12.1898", b"12.1855"))
    err = capfd.readouterr().err.splitlines()
    assert len(err) == 1 and len(err[0]) <= MAX_WIDTH
    assert "over 95% full (12.1898 GB free of 251.972)" in err[0]
    assert "/tmp/ray/session_2026-12-06_19-23-14_731711_30653" in err[0]


def test_the_demo_stops_ray_while_its_stderr_is_still_filtered(monkeypatch):
    # Ray's processes print through the driver (the raylet's disk warning, every 10 s) until
    # Ray stops: stopped after the filter, a warning in between reached the terminal whole
    # (test_demo_output on a loaded machine).
    import argparse
    import stat

    from prx_assets import cli
    from prx_assets.engine import ray_runtime

    filtered_at_stop = []
    monkeypatch.setattr(cli, "_demo_runs", lambda args: 0)
    monkeypatch.setattr(ray_runtime, "disconnect", lambda: filtered_at_stop.append(
        stat.S_ISFIFO(os.fstat(2).st_mode)))
    assert cli._demo(argparse.Namespace()) == 0
    assert filtered_at_stop == [True]
