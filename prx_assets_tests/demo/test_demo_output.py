"""`prx-assets demo` as `make demo` runs it (its own process, its own Ray, the instance of
a DAGSTER_HOME), on a small corpus: what a person reads is short lines, no third-party
warnings, and Ray's native actor notice said once, never in its own words."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from prx_assets.demo.console import MAX_WIDTH, NATIVE_NOTICES
from prx_assets.testing.images import jpeg_bytes
from prx_assets.testing.sources import write_sources

pytestmark = pytest.mark.e2e  # the demo in a subprocess

REPO = Path(__file__).resolve().parents[2]
SIZES = [(480, 360), (360, 480), (640, 360), (512, 512), (900, 600), (400, 700)]
# What third-party code prints when it is not silenced: Python warnings, Ray's and Lance's
# log lines, native log lines, tracebacks.
THIRD_PARTY = ("Warning", "WARNING", "warnings.warn", "core_worker.cc", "No existing dataset",
               "fork-safe", "Traceback", "(raylet)", "[E ", "[W ")


def small_corpus(root: Path) -> Path:
    images = root / "images"
    images.mkdir(parents=True)
    for i in range(10):
        width, height = SIZES[i % len(SIZES)]
        (images / f"{i:03d}.jpg").write_bytes(jpeg_bytes(width, height, i))
        (images / f"{i:03d}.txt").write_text(f"Soft coloured shapes on a plain ground, {i}.")
    (images / "copy000.jpg").write_bytes(jpeg_bytes(*SIZES[0], 0))  # a planted duplicate
    return write_sources(root / "sources.yaml",
                         [f"{{name: web, kind: image_folder, uri: {images}}}"])


def test_the_demos_output_is_short_lines_without_third_party_noise(tmp_path: Path):
    sources = small_corpus(tmp_path / "corpus")
    home = tmp_path / "home"
    home.mkdir()
    shutil.copy(REPO / "dagster.yaml", home / "dagster.yaml")
    env = {**os.environ, "DAGSTER_HOME": str(home), "PRX_DATA_ROOT": str(tmp_path / "data"),
           "PRX_SOURCES": str(sources), "HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0",
           # The raylet's "disk over N% full" warning, every 10 s (it broke this test on a
           # machine whose disk was 95% full): forced here, so it is always filtered.
           "RAY_local_fs_capacity_threshold": "0.01"}
    for name in ("RAY_ADDRESS", "RAY_AUTH_MODE", "LANCE_LOG"):
        env.pop(name, None)
    run = subprocess.run([sys.executable, "-m", "prx_assets.cli", "demo",
                          "--dir", str(sources.parent)],
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    lines = (run.stdout + run.stderr).splitlines()
    assert run.returncode == 0, "\n".join(lines[-40:])
    assert [line for line in lines if len(line) > MAX_WIDTH] == []
    assert [line for line in lines if any(mark in line for mark in THIRD_PARTY)] == []
    # The notice Ray's C++ core logs for every actor pool: its note, at most once.
    assert sum(line == NATIVE_NOTICES[0][1] for line in lines) <= 1
    assert sum("objects Ray must spill will fail" in line for line in lines) <= 1
    assert any("samples in shards" in line for line in lines)
    assert any(line.strip().startswith("make ui") for line in lines)
