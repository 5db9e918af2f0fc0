"""Captioning benchmarks.

1. CPU feed rate per core: read bucketed JPEGs from Lance, decode with DCT-domain downscale to
   the VLM pixel budget and build the vLLM request (what the CPU side must sustain so a GPU
   never waits), against a naive full decode + resize. Stated as the cores one H200 at the
   design's ~20 images/s needs.
2. Pipeline overhead: the tiny Qwen3-VL through our Ray Data path (actor pool, chunked Lance
   commits) against calling its generate loop directly on the same batches in one process.
"""

from __future__ import annotations

import io
import math
import os
import tempfile
from pathlib import Path

import lance
import numpy as np
import pyarrow as pa
from PIL import Image

from bench.common import Figure, report, timed
from prx_assets.s3_captions.captioners import CaptionerSpec, TransformersCaptioner, vllm_preprocess
from prx_assets.demo.corpus import encode, procedural_image

H200_IMAGES_PER_S = 20.0
TIER_SHAPES = ((1024, 1024), (1184, 880), (880, 1184), (1440, 720), (2048, 2048), (512, 512))


def bucketed_table(path: Path, count: int) -> Path:
    rng = np.random.default_rng(5)
    images = [encode(procedural_image(rng, *TIER_SHAPES[i % len(TIER_SHAPES)]), "JPEG", 92)
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


def pipeline_overhead(work: Path, uri: Path, count: int) -> tuple[float, float]:
    from prx_assets.engine import ray_runtime
    from prx_assets.s3_captions.runs import caption_source, pending_requests
    from prx_assets_tests.fixtures.tiny_vlm import build_tiny_qwen3_vl

    import ray.data

    model = build_tiny_qwen3_vl(work / "tiny-qwen3-vl")
    spec = CaptionerSpec(backend="transformers", model=str(model), max_tokens=32,
                         temperature=0.0, image_budget=128 * 128, batch_size=8,
                         cpus_per_actor=1)
    table = lance.dataset(str(uri)).to_table(columns=["id", "image"]).slice(0, count)

    def direct() -> None:
        captioner = TransformersCaptioner(spec)
        for batch in table.to_batches(max_chunksize=spec.batch_size):
            captioner({"id": np.array(batch.column("id").to_pylist(), dtype=object),
                       "image": np.array(batch.column("image").to_pylist(), dtype=object)})

    direct_s, _ = timed(direct)
    # Two CPUs: one for the model actor (one torch thread, like the direct loop), one for the
    # read and commit tasks (with one CPU the actor would hold it and starve the reads).
    started = ray_runtime.connect(num_cpus=2)
    try:
        bucketed = ray.data.read_lance(str(uri)).limit(count)
        out = work / "captions.lance"
        pipeline_s, _ = timed(lambda: caption_source(
            pending_requests(bucketed, None, out, spec), out, spec, chunk_rows=64))
    finally:
        if started:
            ray_runtime.disconnect()
    return direct_s, pipeline_s


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
        direct_s, pipeline_s = pipeline_overhead(work, uri, 64)
        figures.append(Figure("captions", "tiny VLM pipeline seconds", pipeline_s,
                              "direct generate loop", direct_s, "s"))
        report(figures, "captions")
        print(f"captions   pipeline overhead {100 * (pipeline_s / direct_s - 1):.0f}% "
              f"(target < 25%)")


if __name__ == "__main__":
    main()
