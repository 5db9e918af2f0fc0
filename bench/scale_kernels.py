"""bench.scale's baseline: every stage's per-image kernel (ingest's read, probe and
sha256; the image stage's decode, filter, bucket, Lanczos, Q92 and phash; the embedded
classifier and the caption-derived attributes on the captions; the MDS write of the kept
samples; the corpus thumbnail) run alone in a plain pool over the same files, each timed."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from bench.scale_corpus import image_path

KERNEL_CHUNK = 32  # files a pool task

_worker: dict = {}


def _kernel_worker_init(out_dir: str) -> None:
    from prx_assets.engine.ray_runtime import return_freed_memory
    from prx_assets.models.embeddings import MiniLMEmbedder
    from prx_assets.stages.attributes.caption_derived import CaptionAttributer
    from prx_assets.stages.labels.labels import load_embedded_classifier

    # The allocator settings the pipeline's Ray workers run with (ray_runtime.MALLOC_ENV):
    # they make decoding itself faster (fewer heap trims and page faults), which is the
    # kernel's speed, not the pipeline's.
    return_freed_memory()
    started, cpu_started = time.perf_counter(), time.process_time()
    embedder = MiniLMEmbedder(threads=1)
    # attributes' configured default (caption-derived, MiniLM on the CPU): it embeds the
    # captions itself, as the stage's actors do.
    _worker.update(embedder=embedder, classifier=load_embedded_classifier(),
                   attributer=CaptionAttributer(embedder=embedder),
                   out=Path(out_dir) / str(os.getpid()), chunks=0)
    _worker["load_s"] = time.perf_counter() - started
    _worker["load_cpu_s"] = time.process_time() - cpu_started


def kernel_chunk(job: tuple[str, list[str]]) -> dict:
    """Every kernel on one chunk of files; seconds per kernel (and the one-off model load)."""
    from streaming import MDSWriter

    from prx_assets.stages.corpus.corpus import thumbnail
    from prx_assets.stages.images.imaging import process_image
    from prx_assets.stages.ingest.raw_rows import raw_row
    from prx_assets.stages.ingest.readers import read_image_file
    from prx_assets.stages.ingest.sources import SourceSpec
    from prx_assets.stages.shards.plan import MDS_COLUMNS

    root, files = job
    spec = SourceSpec(name="kernel", kind="image_folder", uri=root)
    started_at = time.time()  # wall clock: compared across the pool's processes
    cpu_started = time.process_time()
    seconds: Counter = Counter()
    kept = []
    for rel in files:
        t0 = time.perf_counter()
        row = raw_row(spec.name, read_image_file(spec, Path(root), rel))
        t1 = time.perf_counter()
        seconds["ingest"] += t1 - t0
        if row["status"] != "ok":
            continue
        result = process_image(row["image"])
        seconds["image"] += time.perf_counter() - t1
        if result.status == "ok":
            kept.append((row, result))
    t0 = time.perf_counter()
    captions = [row["original_caption"] or "" for row, _ in kept]
    _worker["classifier"].scores(_worker["embedder"].embed(captions))
    t_labels = time.perf_counter()
    _worker["attributer"].records(captions)
    t1 = time.perf_counter()
    out = _worker["out"] / f"chunk{_worker['chunks']:05d}"
    _worker["chunks"] += 1
    with MDSWriter(columns=MDS_COLUMNS, out=str(out), size_limit=128 << 20,
                   compression=None) as writer:
        for (row, result), caption in zip(kept, captions, strict=True):
            writer.write({"image": result.image, "caption": caption, "id": row["id"],
                          "source": row["source"], "width": result.width,
                          "height": result.height, "original_width": result.original_width,
                          "original_height": result.original_height, "license": "unknown",
                          "url": "", "license_url": "", "attribution": ""})
    t2 = time.perf_counter()
    for _, result in kept:
        thumbnail(result.image)
    t3 = time.perf_counter()
    shutil.rmtree(out, ignore_errors=True)
    seconds.update(labels=t_labels - t0, attributes=t1 - t_labels, mds=t2 - t1,
                   thumbnail=t3 - t2)
    # The model load is counted once per worker, with its first chunk.
    load_s, _worker["load_s"] = _worker.get("load_s", 0.0), 0.0
    load_cpu_s, _worker["load_cpu_s"] = _worker.get("load_cpu_s", 0.0), 0.0
    return {"files": len(files), "kept": len(kept), "seconds": dict(seconds),
            "cpu_s": time.process_time() - cpu_started + load_cpu_s, "model_load_s": load_s,
            "load_cpu_s": load_cpu_s, "started_at": started_at,
            "mds_bytes": sum(len(result.image) for _, result in kept)}


@dataclass
class KernelRun:
    images: int
    seconds: float  # wall of the pool, start to end (spawn, imports, model loads included)
    processes: int
    per_kernel: dict[str, float]  # summed over processes (CPU-ish seconds)
    kept: int
    model_load_s: float
    cpu_seconds: float = 0.0  # process CPU time of the kernels (robust to a loaded machine)
    mds_bytes: int = 0  # bucketed JPEG bytes written to MDS
    startup_s: float = 0.0  # pool start to its first task: spawn, imports, model load
    load_cpu_s: float = 0.0  # CPU seconds of the workers' model loads (in cpu_seconds)

    def plus(self, other: KernelRun) -> KernelRun:
        """The kernels over both runs' files as one pool: `other`'s pool start (its start-up
        wall, its model loads' CPU) is left out, so the sum counts one, like a single pool."""
        per_kernel = Counter(self.per_kernel)
        per_kernel.update(other.per_kernel)
        return KernelRun(self.images + other.images,
                         self.seconds + other.seconds - other.startup_s, self.processes,
                         dict(per_kernel), self.kept + other.kept, self.model_load_s,
                         self.cpu_seconds + other.cpu_seconds - other.load_cpu_s,
                         self.mds_bytes + other.mds_bytes, self.startup_s, self.load_cpu_s)


def kernel_jobs(corpus: Path, start: int, stop: int) -> list[tuple[str, list[str]]]:
    files = [image_path(corpus, i).name for i in range(start, stop)]
    root = str(corpus / "images")
    return [(root, files[i:i + KERNEL_CHUNK]) for i in range(0, len(files), KERNEL_CHUNK)]


def run_kernels(corpus: Path, start: int, stop: int, processes: int, work: Path) -> KernelRun:
    """The kernels over images start..stop-1 in a plain pool of `processes` (their MDS
    output under `work`, removed after)."""
    out = Path(tempfile.mkdtemp(prefix="kernels-", dir=work))
    started, created_at = time.perf_counter(), time.time()
    try:
        with multiprocessing.get_context("spawn").Pool(
                processes, initializer=_kernel_worker_init, initargs=(str(out),)) as pool:
            results = pool.map(kernel_chunk, kernel_jobs(corpus, start, stop), chunksize=1)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    seconds = time.perf_counter() - started
    per_kernel: Counter = Counter()
    for r in results:
        per_kernel.update(r["seconds"])
    return KernelRun(stop - start, seconds, processes, dict(per_kernel),
                     sum(r["kept"] for r in results), sum(r["model_load_s"] for r in results),
                     sum(r["cpu_s"] for r in results), sum(r["mds_bytes"] for r in results),
                     min(r["started_at"] for r in results) - created_at,
                     sum(r["load_cpu_s"] for r in results))
