"""Failpoints: unarmed they do nothing; armed, the first process to reach one writes the
marker and holds until killed, every later one passes through. Armed processes are real
subprocesses (the variables are read at import, as in a Dagster run or a Ray worker)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prx_assets.storage import failpoints
from prx_assets.storage.failpoints import POINTS, failpoint, read_marker

REPO = Path(__file__).resolve().parents[2]
POINT = "images.bucket_batch"
SCRIPT = ("from prx_assets.storage.failpoints import failpoint\n"
          f"failpoint({POINT!r})\nprint('passed', flush=True)\n")


def hit(marker: Path, points: str | list[str] = POINT) -> subprocess.Popen:
    """A process that reaches `POINT` once, then prints `passed` and exits."""
    env = {**os.environ, **failpoints.env(points, marker)}
    return subprocess.Popen([sys.executable, "-c", SCRIPT], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, text=True)


def wait_for_marker(marker: Path, *processes: subprocess.Popen) -> dict:
    """Until the marker exists; every process ending first is a failure (none held)."""
    deadline = time.time() + 120  # a safety net only: the marker is the signal
    while time.time() < deadline:
        found = read_marker(marker)
        if found:
            return found
        assert any(p.poll() is None for p in processes), "all exited without holding"
        time.sleep(0.02)
    raise AssertionError("no marker written")


def kill(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)


def test_unarmed_points_do_nothing(tmp_path):
    assert not failpoints._ARMED  # the test session itself is never armed
    for name in POINTS:
        failpoint(name)


def test_armed_point_writes_marker_and_holds_until_killed(tmp_path):
    marker = tmp_path / "marker"
    process = hit(marker)
    found = wait_for_marker(marker, process)
    assert found["failpoint"] == POINT and found["pid"] == process.pid
    assert Path(found["module"]) == REPO / "prx_assets" / "storage" / "failpoints.py"
    kill(process)
    assert process.returncode == -signal.SIGKILL, "it ended on its own instead of holding"
    assert "passed" not in process.stdout.read()
    assert [p.name for p in tmp_path.iterdir()] == ["marker"]  # no temporary left


def test_point_fires_once_per_marker(tmp_path):
    marker = tmp_path / "marker"
    marker.write_text('{"failpoint": "images.bucket_batch", "pid": 1, "module": ""}')
    process = hit(marker)
    out, _ = process.communicate(timeout=120)
    assert process.returncode == 0 and out.strip() == "passed"
    assert read_marker(marker)["pid"] == 1


def test_one_holder_among_concurrent_hits(tmp_path):
    marker = tmp_path / "marker"
    processes = [hit(marker) for _ in range(4)]
    try:
        holder = wait_for_marker(marker, *processes)["pid"]
        others = [p for p in processes if p.pid != holder]
        assert len(others) == 3, "the marker names one of the processes"
        for process in others:  # they pass through and exit by themselves
            out, _ = process.communicate(timeout=120)
            assert process.returncode == 0 and out.strip() == "passed"
        (held,) = [p for p in processes if p.pid == holder]
        assert held.poll() is None
    finally:
        for process in processes:
            if process.poll() is None:
                kill(process)
    assert held.returncode == -signal.SIGKILL


def test_other_points_pass_through(tmp_path):
    marker = tmp_path / "marker"
    process = hit(marker, "captions.chunk_committed")
    out, _ = process.communicate(timeout=120)
    assert process.returncode == 0 and out.strip() == "passed" and not marker.exists()


def test_armed_without_marker_fails_clearly(monkeypatch):
    monkeypatch.setattr(failpoints, "_ARMED", frozenset({POINT}))
    monkeypatch.setattr(failpoints, "_MARKER", None)
    with pytest.raises(RuntimeError, match="PRX_FAILPOINT_FILE"):
        failpoint(POINT)


def test_unknown_point_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"unknown failpoint.*ingest\.expand_units"):
        failpoints.env("ingest.typo", tmp_path / "marker")


def test_forwarded_env_only_when_armed(monkeypatch, tmp_path):
    monkeypatch.delenv(failpoints.ENV_POINTS, raising=False)
    monkeypatch.delenv(failpoints.ENV_MARKER, raising=False)
    assert failpoints.forwarded_env() == {}
    monkeypatch.setenv(failpoints.ENV_POINTS, POINT)
    monkeypatch.setenv(failpoints.ENV_MARKER, str(tmp_path / "m"))
    assert failpoints.forwarded_env() == {"PRX_FAILPOINT": POINT,
                                          "PRX_FAILPOINT_FILE": str(tmp_path / "m")}


def test_every_point_sits_in_exactly_one_place():
    calls: dict[str, list[str]] = {}
    for path in sorted((REPO / "prx_assets").rglob("*.py")):
        if path.name == "failpoints.py":
            continue
        # A call, or a stage's declaration (`failpoint = "..."`, hit by engine.stage).
        for name in re.findall(r"""\bfailpoint(?:\(\s*|\s*=\s*)["']([^"']+)["']""",
                               path.read_text()):
            calls.setdefault(name, []).append(str(path.relative_to(REPO)))
    assert set(calls) == set(POINTS), "POINTS lists every failpoint a stage calls, no more"
    assert all(len(places) == 1 for places in calls.values()), calls
