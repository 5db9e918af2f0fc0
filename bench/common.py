"""Helpers shared by the benchmarks: timing, corpus generation and result reporting.

Every figure is a ratio against a baseline measured in the same run, since the machines
are shared and noisy; absolute numbers are printed for context only.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from prx_assets.testing.s3_server import S3Server

OUT = Path(__file__).parent / "out"


@dataclass
class Figure:
    stage: str
    metric: str
    value: float
    baseline_name: str
    baseline_value: float
    unit: str

    @property
    def ratio(self) -> float:
        return self.value / self.baseline_value if self.baseline_value else float("nan")

    def line(self) -> str:
        return (f"{self.stage:<10} {self.metric:<28} {self.value:10.1f} {self.unit:<10} "
                f"baseline [{self.baseline_name}] {self.baseline_value:10.1f}  "
                f"ratio {self.ratio:5.2f}x")


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def release_loader(dataset: Any) -> None:
    """Let a project loader's trees go once a bench is done with it: its reader-lease
    renewer thread would otherwise outlive the storage it writes to (the S3 server that
    `bench.s3` stops) and log a failure every beat until the process ends."""
    if dataset.reader_leases is not None:
        dataset.reader_leases.release()


def generated_jpegs(directory: Path, count: int, seed: int = 0,
                    sizes: tuple[tuple[int, int], ...] = ((1600, 1200), (1200, 1600), (2048, 1365),
                                                          (1024, 1024), (2400, 1600))) -> Path:
    """A folder of generated photo-like JPEGs (cached between runs)."""
    from prx_assets.demo.corpus import encode, procedural_image

    directory.mkdir(parents=True, exist_ok=True)
    existing = len(list(directory.glob("*.jpg")))
    rng = np.random.default_rng(seed)
    for i in range(count):
        w, h = sizes[i % len(sizes)]
        img = procedural_image(rng, w, h)
        if i >= existing:
            (directory / f"{i:06d}.jpg").write_bytes(encode(img, "JPEG", 90))
    return directory


def report(figures: list[Figure], name: str) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for figure in figures:
        print(figure.line())
    data = [asdict(f) | {"ratio": f.ratio} for f in figures]
    (OUT / f"{name}.json").write_text(json.dumps(data, indent=2))


def cpu_count() -> int:
    return len(os.sched_getaffinity(0))


@contextlib.contextmanager
def s3_workspace(prefix: str) -> Iterator[tuple[Path, S3Server]]:
    """A scratch folder under bench/out and a SeaweedFS server in it, for a bench that
    compares local disk with a bucket. On the way out: Ray disconnected, the environment
    restored (the bench puts the server's AWS variables in it when it wants them), the
    server stopped and the folder removed."""
    from prx_assets.engine import ray_runtime
    from prx_assets.testing.s3_server import start_seaweedfs

    OUT.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=prefix, dir=OUT))
    server = start_seaweedfs(work / "server")
    saved = dict(os.environ)
    try:
        yield work, server
    finally:
        ray_runtime.disconnect()
        os.environ.clear()
        os.environ.update(saved)
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
