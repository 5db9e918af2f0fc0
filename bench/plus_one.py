"""A +1-file run (`python -m bench.incremental --plus-one --images N`): what a sensor-started
run costs when one file lands in a partition of N images (issue 31, point 5: under 60 s at
N = 10⁴ on the shared 2-core machine).

1. The partition, built once and cached under bench/out/plus_one_<N>/: N small generated
   JPEGs (400-640 px, all above the 384² floor, each with its `original` caption sidecar),
   and the whole graph run over them as `make demo` runs it (`materialize_all`: every
   per-source asset and its checks, dedup, skip lists, the corpus table and the first
   subset) in a child process on a fresh data root and instance. Its figures are kept
   beside the snapshot (full.json), so a rerun of the bench reuses them.
2. The snapshot restored to the same working path (absolute paths inside stay valid), one
   more image (and its sidecar) added, and the whole graph run again, in a fresh child
   process (its own Ray start, as a sensor's run has).

Printed: end to end (the child's wall, with imports and Ray start), Ray start, each step's
seconds in the full and the +1 run, the checks' total, and the +1 run against the 60 s
target and as a share of the full run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench.common import OUT, Figure

TARGET_S = 60.0
SOURCE = "plus_one"
POOL = OUT / "plus_one_pool"
# Small shapes above the 384² floor with aspects inside [0.5, 2]: cheap to build at 10⁴.
SIZES = ((640, 480), (480, 640), (512, 512), (600, 400), (400, 600), (560, 420))
# Steps of the per-source assets; the rest are checks and global jobs.
STAGE_STEPS = ("raw_images", "image_stage", "captions", "caption_labels", "mds_shards",
               "skip_lists", "corpus")


def pool_image(index: int) -> Path:
    return POOL / f"{index:06d}.jpg"


def build_pool(count: int) -> None:
    """Images 0..count-1, each from its own seed (any prefix is the same images), cached."""
    from prx_assets.demo.corpus import encode, procedural_image

    POOL.mkdir(parents=True, exist_ok=True)
    for index in range(count):
        path = pool_image(index)
        if path.exists():
            continue
        width, height = SIZES[index % len(SIZES)]
        image = procedural_image(np.random.default_rng((20261202, index)), width, height)
        path.with_suffix(".txt").write_text(
            f"generated picture {index}: soft shapes and gradients on a plain ground, "
            f"variant {index % 97}")
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(encode(image, "JPEG", 88))
        tmp.rename(path)  # the image last: a present image has its sidecar


def add_image(folder: Path, index: int) -> None:
    for path in (pool_image(index), pool_image(index).with_suffix(".txt")):
        os.link(path, folder / path.name)


class Partition:
    """The working folder of a bench partition (source, data root, instance, sources file)
    and the snapshot of it after the full run."""

    def __init__(self, images: int):
        self.images = images
        self.base = OUT / f"plus_one_{images}"
        self.work = self.base / "work"
        self.snapshot = self.base / "snapshot"
        self.full_json = self.base / "full.json"
        self.folder = self.work / "source"
        self.data_root = self.work / "data"
        self.home = self.work / "dagster_home"
        self.sources = self.work / "sources.yaml"

    def cached(self) -> bool:
        return self.snapshot.is_dir() and self.full_json.exists()

    def fresh(self) -> None:
        from bench.scale import DAGSTER_YAML

        shutil.rmtree(self.work, ignore_errors=True)
        self.folder.mkdir(parents=True)
        self.home.mkdir(parents=True)
        (self.home / "dagster.yaml").write_text(DAGSTER_YAML.format(home=self.home))
        self.sources.write_text(f"sources:\n  - {{name: {SOURCE}, kind: image_folder, "
                                f"uri: {self.folder}, license: generated}}\n")
        for index in range(self.images):
            add_image(self.folder, index)

    def save(self) -> None:
        shutil.rmtree(self.snapshot, ignore_errors=True)
        shutil.copytree(self.work, self.snapshot, symlinks=True)

    def restore(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)
        shutil.copytree(self.snapshot, self.work, symlinks=True)


def run_graph(partition: Partition, label: str) -> dict:
    """materialize_all in a child process (bench.scale's child: Ray start timed apart, step
    seconds from the event log); its wall start to exit."""
    env = {**os.environ, "PRX_DATA_ROOT": str(partition.data_root),
           "PRX_SOURCES": str(partition.sources), "DAGSTER_HOME": str(partition.home),
           "PRX_CAPTIONER": str(partition.work / "no-captioner.yaml"),
           "HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}
    env.pop("RAY_ADDRESS", None)
    result = partition.base / f"{label}.json"
    log_path = partition.base / f"{label}.log"
    started = time.perf_counter()
    with open(log_path, "w") as log:
        code = subprocess.call(
            [sys.executable, "-m", "bench.scale", "--child", str(partition.sources),
             str(result)], env=env, stdout=log, stderr=subprocess.STDOUT,
            cwd=Path(__file__).resolve().parent.parent)
    wall = time.perf_counter() - started
    if code != 0 or not result.exists():
        raise RuntimeError(f"the {label} run failed ({code}):\n{log_path.read_text()[-3000:]}")
    figures = json.loads(result.read_text()) | {"wall_s": wall}
    if not figures["success"]:
        print(f"plus-one: WARNING: the {label} run had failures: {figures['failed']}")
    result.write_text(json.dumps(figures, indent=2))
    return figures


def full_run(partition: Partition, rebuild: bool) -> dict:
    if partition.cached() and not rebuild:
        print(f"plus-one: the {partition.images}-image partition from {partition.snapshot}")
        return json.loads(partition.full_json.read_text())
    build_pool(partition.images + 1)
    partition.fresh()
    full = run_graph(partition, "full")
    partition.save()
    return full


def measure(images: int, rebuild: bool = False) -> list[Figure]:
    partition = Partition(images)
    partition.base.mkdir(parents=True, exist_ok=True)
    full = full_run(partition, rebuild)
    build_pool(images + 1)
    partition.restore()
    add_image(partition.folder, images)
    plus = run_graph(partition, "plus")
    return print_figures(images, full, plus)


def check_steps(steps: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in steps.items() if k not in STAGE_STEPS}


def print_figures(images: int, full: dict, plus: dict) -> list[Figure]:
    print(f"plus-one bench: {images} images, then +1; target {TARGET_S:.0f} s end to end")
    for label, run in (("full", full), ("+1", plus)):
        print(f"  {label}: end to end {run['wall_s']:.1f} s (Ray start {run['ray_start_s']:.1f} "
              f"s, materialize_all {run['materialize_s']:.1f} s); steps "
              f"{sum(run['steps'].values()):.1f} s, of which checks and global steps "
              f"{sum(check_steps(run['steps']).values()):.1f} s")
    print(f"  +1 run: {plus['wall_s']:.1f} s = {plus['wall_s'] / TARGET_S:.2f}x the target, "
          f"{plus['wall_s'] / full['wall_s']:.3f}x the full run")
    print(f"  {'step':<44} {'full s':>8} {'+1 s':>8}")
    for step in sorted(set(full["steps"]) | set(plus["steps"]),
                       key=lambda s: -plus["steps"].get(s, 0.0)):
        print(f"  {step:<44} {full['steps'].get(step, 0.0):8.1f} "
              f"{plus['steps'].get(step, 0.0):8.1f}")
    print("  per run (job: seconds, +1): " + ", ".join(
        f"{job} {s:.1f}" for job, s in sorted(plus["run_seconds"].items())))
    return [Figure("graph", "+1 file run s", plus["wall_s"], "target", TARGET_S, "s"),
            Figure("graph", "+1 file run s", plus["wall_s"], "full run", full["wall_s"], "s")]
