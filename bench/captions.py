"""Captioning benchmarks.

1. CPU feed rate per core: read bucketed JPEGs from Lance, decode with DCT-domain downscale to
   the VLM pixel budget and build the vLLM request (what the CPU side must sustain so a GPU
   never waits), against a naive full decode + resize. Stated as the cores one H200 at the
   design's ~20 images/s needs.
2. Pipeline overhead: the tiny Qwen3-VL through our Ray Data path (`caption_source`: Lance
   read, actor pool, chunked Lance commits) against calling its generate loop directly on the
   same batches in one process (the model loaded the same way), on 384 small images
   (PRX_CAPTION_BENCH_IMAGES) so that steady state dominates. Start-up is named apart: for
   the direct loop the model load; for the pipeline Ray start, then the time to the first
   committed chunk (actor creation, model load, the chunk's own images, the commit). Steady
   state is the images after the first chunk, first to last commit (the direct loop: after
   its first chunk of as many images, to its last batch). The overhead is printed for steady
   state alone and for the whole run, start-up included.
"""

from __future__ import annotations

import io
import json
import math
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import lance
import numpy as np
import pyarrow as pa
from PIL import Image

from bench.common import OUT, Figure, report, timed
from bench.proc_memory import cpu_seconds, descendants
from prx_assets.demo.corpus import encode, procedural_image
from prx_assets.stages.captions.captioners import (
    CaptionerSpec,
    TransformersCaptioner,
    vllm_preprocess,
)
from prx_assets.storage.refs import TableRef

H200_IMAGES_PER_S = 20.0
TIER_SHAPES = ((1024, 1024), (1184, 880), (880, 1184), (1440, 720), (2048, 2048), (512, 512))
# The overhead run's images: small (the model sees 128² anyway), so the run is long in images
# and short in seconds.
SMALL_SHAPES = ((512, 512), (592, 440), (440, 592), (720, 360))
OVERHEAD_IMAGES = 384
CHUNK_ROWS = 64  # rows per Lance commit in the pipeline, and per timing mark in both loops


def bucketed_table(path: Path, count: int, shapes: tuple[tuple[int, int], ...] = TIER_SHAPES
                   ) -> Path:
    rng = np.random.default_rng(5)
    images = [encode(procedural_image(rng, *shapes[i % len(shapes)]), "JPEG", 92)
              for i in range(count)]
    table = pa.table({"id": [f"bench:{i:05d}" for i in range(count)], "status": ["ok"] * count,
                      "image": pa.array(images, pa.large_binary())})
    lance.write_dataset(table, str(path), mode="overwrite")
    return path


def feed(uri: Path, spec: CaptionerSpec) -> int:
    preprocess = vllm_preprocess(spec)
    n = 0
    for batch in lance.dataset(str(uri)).to_batches(columns=["id", "image"], batch_size=64):
        for row in batch.to_pylist():
            preprocess(row)
            n += 1
    return n


def naive_feed(uri: Path, spec: CaptionerSpec) -> int:
    n = 0
    for batch in lance.dataset(str(uri)).to_batches(columns=["id", "image"], batch_size=64):
        for row in batch.to_pylist():
            img = Image.open(io.BytesIO(row["image"])).convert("RGB")
            scale = min(1.0, math.sqrt(spec.image_budget / (img.width * img.height)))
            img.resize((round(img.width * scale), round(img.height * scale)), Image.LANCZOS)
            n += 1
    return n


@dataclass
class LoopTiming:
    """One captioning loop over `images`, timed in phases (seconds)."""

    images: int
    startup_s: float  # direct: the model load; pipeline: Ray start
    first_chunk_s: float  # to the first CHUNK_ROWS images done (pipeline: committed)
    steady_s: float  # from there to the last images done (committed)
    steady_images: int
    finish_s: float  # after the last images: the pipeline's compaction, nothing for direct
    steady_cpu_s: float = 0.0  # CPU seconds of this process's tree over the steady phase
    marks: list = field(default_factory=list)  # (seconds from the start, images, tree CPU s)

    @property
    def total_s(self) -> float:
        return self.startup_s + self.first_chunk_s + self.steady_s + self.finish_s

    @property
    def steady_ms_per_image(self) -> float:
        return 1000 * self.steady_s / self.steady_images

    @property
    def steady_cpu_ms_per_image(self) -> float:
        return 1000 * self.steady_cpu_s / self.steady_images


def phases(startup_s: float, started: float, marks: list[tuple[float, int, float]],
           ended: float) -> LoopTiming:
    """A LoopTiming from the (time, images done, tree CPU seconds) marks taken after each
    chunk."""
    if len(marks) < 2:
        raise ValueError(f"need at least two chunks to time steady state, got {len(marks)}")
    (first_t, first_n, first_cpu), (last_t, last_n, last_cpu) = marks[0], marks[-1]
    return LoopTiming(last_n, startup_s, first_t - started, last_t - first_t, last_n - first_n,
                      ended - last_t, last_cpu - first_cpu,
                      [(t - started, n, cpu) for t, n, cpu in marks])


def mark(images: int) -> tuple[float, int, float]:
    """Now, the images done, and the CPU seconds of this process and everything under it
    (Ray's workers, raylet and GCS too): on a shared machine CPU time, unlike wall time,
    does not measure the neighbours."""
    return time.perf_counter(), images, sum(cpu_seconds(pid) for pid in descendants(os.getpid()))


def tiny_spec(work: Path) -> CaptionerSpec:
    from prx_assets.testing.tiny_vlm import build_tiny_qwen3_vl

    model = build_tiny_qwen3_vl(work / "tiny-qwen3-vl")
    return CaptionerSpec(backend="transformers", model=str(model), max_tokens=32,
                         temperature=0.0, image_budget=128 * 128, batch_size=8,
                         cpus_per_actor=1)


def direct_loop(uri: Path, spec: CaptionerSpec, count: int) -> LoopTiming:
    """The captioner called in this process on the pipeline's batches (`batch_size` rows in
    table order), as the actor would be; the table is read before the clock starts."""
    table = lance.dataset(str(uri)).to_table(columns=["id", "image"]).slice(0, count)
    table = table.combine_chunks()
    started = time.perf_counter()
    captioner = TransformersCaptioner(spec)
    load_s = time.perf_counter() - started
    started, marks, done = time.perf_counter(), [], 0
    for batch in table.to_batches(max_chunksize=spec.batch_size):
        captioner({"id": np.array(batch.column("id").to_pylist(), dtype=object),
                   "image": np.array(batch.column("image").to_pylist(), dtype=object)})
        done += batch.num_rows
        if done % CHUNK_ROWS == 0 or done == count:
            marks.append(mark(done))
    return phases(load_s, started, marks, time.perf_counter())


def pipeline_loop(work: Path, uri: Path, spec: CaptionerSpec, count: int) -> LoopTiming:
    """`caption_source` from a fresh Ray: the read, the actor pool and the chunked commits."""
    import ray.data

    from prx_assets.engine import ray_runtime
    from prx_assets.stages.captions.runs import caption_source, pending_requests

    t0 = time.perf_counter()
    # Two CPUs: one for the model actor (one torch thread, like the direct loop), one for the
    # read and commit tasks (with one CPU the actor would hold it and starve the reads).
    started_ray = ray_runtime.connect(num_cpus=2)
    ray_s = time.perf_counter() - t0
    marks: list[tuple[float, int, float]] = []
    try:
        bucketed = ray.data.read_lance(str(uri)).limit(count)
        out = TableRef.of(work / "captions.lance")
        started = time.perf_counter()
        caption_source(pending_requests(bucketed, None, out, spec), out, spec,
                       chunk_rows=CHUNK_ROWS,
                       on_chunk=lambda r: marks.append(mark(r.commits.rows)))
        ended = time.perf_counter()
    finally:
        if started_ray:
            ray_runtime.disconnect()
    return phases(ray_s, started, marks, ended)


def overhead_figures(direct: LoopTiming, pipeline: LoopTiming) -> list[Figure]:
    return [
        Figure("captions", "tiny VLM steady ms/img", pipeline.steady_ms_per_image,
               "direct generate loop", direct.steady_ms_per_image, "ms"),
        Figure("captions", "tiny VLM steady CPU ms/img", pipeline.steady_cpu_ms_per_image,
               "direct generate loop", direct.steady_cpu_ms_per_image, "ms"),
        Figure("captions", "tiny VLM run s (start-up in)", pipeline.total_s,
               "direct, model load in", direct.total_s, "s"),
        Figure("captions", "tiny VLM start-up s", pipeline.startup_s + pipeline.first_chunk_s
               - direct.first_chunk_s, "direct: model load", direct.startup_s, "s"),
    ]


def print_overhead(direct: LoopTiming, pipeline: LoopTiming) -> None:
    print(f"captions   tiny VLM, {direct.images} images, chunks of {CHUNK_ROWS}: direct: "
          f"model load {direct.startup_s:.1f} s, first chunk {direct.first_chunk_s:.1f} s, "
          f"steady {direct.steady_s:.1f} s for {direct.steady_images}; pipeline: Ray start "
          f"{pipeline.startup_s:.1f} s, to the first commit {pipeline.first_chunk_s:.1f} s "
          f"(actor, model load, {CHUNK_ROWS} images, commit), steady {pipeline.steady_s:.1f} s "
          f"for {pipeline.steady_images}, compaction {pipeline.finish_s:.1f} s")
    steady = pipeline.steady_ms_per_image / direct.steady_ms_per_image - 1
    steady_cpu = pipeline.steady_cpu_ms_per_image / direct.steady_cpu_ms_per_image - 1
    whole = pipeline.total_s / direct.total_s - 1
    print(f"captions   pipeline overhead: steady state {100 * steady:.0f}% wall, "
          f"{100 * steady_cpu:.0f}% CPU (target <= 25%), whole run with start-up "
          f"{100 * whole:.0f}% wall")


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        uri = bucketed_table(work / "bucketed.lance", 64)
        spec = CaptionerSpec(backend="vllm", model="Qwen/Qwen3-VL-8B-Instruct")
        ours_s, n = timed(lambda: feed(uri, spec))
        naive_s, _ = timed(lambda: naive_feed(uri, spec))
        per_core = n / ours_s
        figures = [
            Figure("captions", "feed images/s per core", per_core,
                   "full decode + Lanczos", n / naive_s, "img/s"),
            Figure("captions", "cores per H200 (20 img/s)", H200_IMAGES_PER_S / per_core,
                   "one core", 1.0, "cores"),
        ]
        count = int(os.environ.get("PRX_CAPTION_BENCH_IMAGES", str(OVERHEAD_IMAGES)))
        small = bucketed_table(work / "small.lance", count, SMALL_SHAPES)
        spec = tiny_spec(work)
        direct = direct_loop(small, spec, count)
        pipeline = pipeline_loop(work, small, spec, count)
        figures += overhead_figures(direct, pipeline)
        report(figures, "captions")
        print_overhead(direct, pipeline)
        (OUT / "captions_details.json").write_text(json.dumps(
            {"direct": asdict(direct), "pipeline": asdict(pipeline)}, indent=2))


if __name__ == "__main__":
    main()
