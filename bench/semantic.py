"""Semantic curation: SemDeDup and concept balancing on synthetic embeddings with known
answers.

1. SemDeDup on PRX_SEMANTIC_ROWS (default 100,000) 128-d unit vectors with planted
   near-duplicate groups: recall and precision of the planted pairs at the default eps,
   and embeddings/s against a brute-force all-pairs pass (every pair's cosine, blocked) on
   the same vectors. The baseline is quadratic: it runs the same block kernel on the first
   PRX_SEMANTIC_BASELINE_ROWS rows of the upper triangle and its time is scaled to the
   whole triangle by the share of cells measured; both times are printed.
2. Concept balancing on a long-tailed mixture (60 topics, power law): largest / median
   leaf cluster before and after hierarchical balancing to 1/8 of the samples (target
   >= 10x flatter), and the fewest samples any leaf keeps (target >= 1).
3. image_embeddings with the tiny random-init CLIP tower: images/s through the stage's
   path (a Lance read, Ray Data, one `VisionEncoder` actor, `write_embeddings` into Lance)
   against a bare loop of the same encoder's decode + forward over the same JPEGs in this
   process (PRX_SEMANTIC_EMBED_IMAGES, default 12,288; 0 skips it). After a warm-up job the stage
   runs on a third of the images and on all: the difference is the marginal cost per image (the
   overhead target's figure); end to end, with Ray Data start and the model load, is
   reported too. The tiny tower makes the fixed costs as visible as they can be.
4. Memory per pairwise task (Python allocation peak of the largest cluster's task) at
   10^5 and 10^6 embeddings: flat, since clusters hold ~5,000 rows whatever the corpus
   (PRX_SEMANTIC_MEMORY_ROWS to change the sizes, e.g. "100000" alone on a small box).
"""

from __future__ import annotations

import io
import os
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pyarrow as pa

from bench.common import Figure, report
from prx_assets.stages.semantic.concepts import (
    balanced_selection,
    hierarchical_kmeans,
    largest_to_median,
)
from prx_assets.stages.semantic.kmeans import normalise
from prx_assets.stages.semantic.semdedup import (
    DEFAULT_BLOCK_ROWS,
    DEFAULT_EPS,
    SemDedupConfig,
    cluster_groups,
    partition,
    semantic_duplicates,
)
from prx_assets.stages.semantic.synthetic import long_tailed_mixture, pairs_of, planted_duplicates
from prx_assets.storage.refs import TableRef

DIM = 128


def env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def brute_force_seconds(vectors: np.ndarray, rows: int, eps: float = DEFAULT_EPS) -> float:
    """Seconds for the all-pairs pass (the per-cluster kernel's block work, one eps, over one
    cluster of every row), measured on the blocks of the first `rows` rows of the upper
    triangle and scaled to the whole triangle by the share of its cells they hold."""
    n = len(vectors)
    rows = min(rows, n)
    start = time.perf_counter()
    for first in range(0, rows, DEFAULT_BLOCK_ROWS):
        block = vectors[first:first + DEFAULT_BLOCK_ROWS] @ vectors[first:].T
        i, j = np.nonzero(block > 1.0 - eps)
        _ = block[i[j > i], j[j > i]]
    measured = time.perf_counter() - start
    cells_measured = rows * n - rows * rows / 2
    return measured * (n * n / 2) / cells_measured


def recall_precision(predicted: set, truth: set) -> tuple[float, float]:
    hits = len(predicted & truth)
    return hits / max(1, len(truth)), hits / max(1, len(predicted))


def semdedup_figures(n: int, baseline_rows: int) -> list[Figure]:
    data = planted_duplicates(n, dim=DIM, seed=0)
    ids = pa.array([f"s:{i}" for i in range(n)])
    start = time.perf_counter()
    result = semantic_duplicates(ids, data.vectors, data.pixels, np.zeros(n, np.int32),
                                 SemDedupConfig())
    ours_s = time.perf_counter() - start
    group = np.full(n, -1, np.int64)
    rows = [int(i.split(":")[1]) for i in result.duplicates.column("id").to_pylist()]
    group[rows] = result.duplicates.column("group").to_numpy()
    recall, precision = recall_precision(pairs_of(group), data.true_pairs())
    baseline_s = brute_force_seconds(data.vectors, baseline_rows)
    print(f"semantic: {n:,} x {DIM}-d, {result.clusters} clusters (largest "
          f"{result.largest_cluster:,}), eps {DEFAULT_EPS}: recall {recall:.4f}, precision "
          f"{precision:.4f}, removed share {result.removed_share()}; ours {ours_s:.1f} s, "
          f"brute force {baseline_s:.1f} s (measured on {min(baseline_rows, n):,} rows of "
          f"the upper triangle, scaled to all of it)")
    return [
        Figure("semantic", "semdedup planted recall", recall, "target", 0.95, "share"),
        Figure("semantic", "semdedup planted precision", precision, "target", 0.95, "share"),
        Figure("semantic", "semdedup embeddings/s", n / ours_s, "brute-force all pairs",
               n / baseline_s, "rows/s"),
    ]


def balance_figures(largest: int = 4000) -> list[Figure]:
    vectors, _ = long_tailed_mixture(topics=60, largest=largest, seed=0)
    tree = hierarchical_kmeans(vectors, (60, 8))
    before = tree.sizes(1)
    keep = balanced_selection(tree, len(vectors) // 8)
    after = np.bincount(tree.leaves[keep], minlength=len(before))
    ratio_before, ratio_after = largest_to_median(before), largest_to_median(after)
    fewest = int(after[before > 0].min())
    print(f"semantic: balance {len(vectors):,} samples, 60 leaves / 8 top: largest/median "
          f"{ratio_before:.1f} -> {ratio_after:.2f} ({ratio_before / ratio_after:.1f}x "
          f"flatter), kept {int(keep.sum()):,}, fewest per leaf {fewest}")
    return [
        Figure("semantic", "balance flatter (x)", ratio_before / ratio_after, "target", 10.0,
               "x"),
        Figure("semantic", "balance fewest per leaf", fewest, "target", 1.0, "samples"),
    ]


def task_peak_bytes(n: int) -> tuple[int, int]:
    """(largest cluster rows, allocation peak of its pairwise task) at `n` embeddings."""
    rng = np.random.default_rng(n)
    centres = rng.normal(size=(200, DIM)).astype(np.float32)
    vectors = normalise(centres[rng.integers(200, size=n)]
                        + rng.normal(size=(n, DIM)).astype(np.float32))
    clusters = partition(vectors, SemDedupConfig())
    largest = max(clusters, key=len)
    part = vectors[largest]
    tracemalloc.start()
    cluster_groups(part, SemDedupConfig().all_eps())
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return len(largest), peak


def memory_figures(sizes: list[int]) -> list[Figure]:
    peaks = {n: task_peak_bytes(n) for n in sizes}
    for n, (rows, peak) in peaks.items():
        print(f"semantic: {n:,} embeddings: largest cluster {rows:,} rows, pairwise task "
              f"peak {peak / 1e6:.1f} MB")
    smallest = peaks[sizes[0]][1]
    return [Figure("semantic", f"task peak MB at {n:.0e}", peak / 1e6,
                   f"task peak at {sizes[0]:.0e}", smallest / 1e6, "MB")
            for n, (_, peak) in peaks.items()]


def pipeline_run(bucketed: TableRef, out: TableRef, ids: list[str], checkpoint: str,
                 encoder: str, batch: int) -> tuple[int, float]:
    """(images written, seconds) of the image_embeddings stage's path, as the asset runs it:
    kept images read from Lance through `VisionEncoder` actors on Ray Data
    (`image_vectors`), written to Lance by `write_embeddings` (one commit per batch)."""
    from prx_assets.engine.batches import arrow_batches
    from prx_assets.stages.semantic.embeddings import image_vectors, write_embeddings

    start = time.perf_counter()
    counts = write_embeddings(out, arrow_batches(
        image_vectors(bucketed, ids, checkpoint, actors=1, batch_size=batch)), encoder, [])
    return counts.written, time.perf_counter() - start


def random_jpegs(count: int, side: int) -> list[bytes]:
    from PIL import Image

    rng = np.random.default_rng(0)
    jpegs = []
    for _ in range(count):
        out = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (side, side, 3), dtype=np.uint8)).save(
            out, "JPEG", quality=92)
        jpegs.append(out.getvalue())
    return jpegs


def embedding_figures(images: int, side: int = 64, batch: int = 32) -> list[Figure]:
    """Images/s of the image_embeddings stage (Lance in, Ray Data actors, Lance out) against
    a bare decode + forward loop of the same encoder over the same JPEGs. The stage runs
    twice after a warm-up job, on a third of the images and on all of them: the difference
    of the two times is the marginal cost of the extra images (Ray Data start and the
    actor's model load cancel out), the figure the overhead target is about; end to end is
    printed too. The tiny tower takes ~0.5 ms an image, so the images must be many for
    the difference to stand out of the fixed costs' noise."""
    from prx_assets.engine import ray_runtime
    from prx_assets.stages.semantic.embeddings import VisionEncoder, encoder_name
    from prx_assets.storage.lance_tables import overwrite_rows
    from prx_assets.testing.tiny_vision import tiny_vision_tower

    ids = [f"bench:{i}" for i in range(images)]
    rows = pa.table({"id": ids, "status": ["ok"] * images, "image": random_jpegs(images, side)})
    third = max(1, images // 3)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = str(tiny_vision_tower(Path(tmp) / "clip"))
        table = TableRef.of(Path(tmp) / "bucketed.lance")
        overwrite_rows(table, rows, rows.schema)
        bare = VisionEncoder(checkpoint)
        start = time.perf_counter()
        for first in range(0, images, batch):
            bare(rows.slice(first, batch))
        bare_s = time.perf_counter() - start
        encoder = encoder_name(checkpoint)
        started = ray_runtime.connect()
        try:
            # The process's first Ray Data job pays once for worker start and imports.
            pipeline_run(table, TableRef.of(Path(tmp) / "warm.lance"), ids[:batch],
                         checkpoint, encoder, batch)
            small = pipeline_run(table, TableRef.of(Path(tmp) / "small.lance"), ids[:third],
                                 checkpoint, encoder, batch)
            full = pipeline_run(table, TableRef.of(Path(tmp) / "full.lance"), ids,
                                checkpoint, encoder, batch)
        finally:
            if started:
                ray_runtime.disconnect()
    if (small[0], full[0]) != (third, images):
        raise RuntimeError(f"the stage wrote {small[0]} of {third}, {full[0]} of {images}")
    bare_rate = images / bare_s
    marginal_s = full[1] - small[1]
    marginal_rate = (images - third) / marginal_s if marginal_s > 0 else float("inf")
    print(f"semantic: image_embeddings {images} {side}px JPEGs, tiny CLIP, batches of "
          f"{batch}: bare loop {bare_rate:.0f} img/s; stage {third} images {small[1]:.1f} s, "
          f"{images} images {full[1]:.1f} s: marginal {marginal_rate:.0f} img/s (overhead "
          f"{bare_rate / marginal_rate - 1:.0%}, target <= 25 %); end to end "
          f"{images / full[1]:.0f} img/s with Ray Data start and model load")
    return [Figure("semantic", "embed images/s marginal (tiny CLIP)", marginal_rate,
                   "bare decode+forward loop", bare_rate, "img/s"),
            Figure("semantic", "embed images/s end to end (tiny CLIP)", images / full[1],
                   "bare decode+forward loop", bare_rate, "img/s")]


def main() -> None:
    n = env_int("PRX_SEMANTIC_ROWS", 100_000)
    baseline_rows = env_int("PRX_SEMANTIC_BASELINE_ROWS", 10_240)
    memory_rows = [int(s) for s in os.environ.get(
        "PRX_SEMANTIC_MEMORY_ROWS", "100000,1000000").split(",")]
    figures = semdedup_figures(n, baseline_rows)
    figures += balance_figures(env_int("PRX_SEMANTIC_LARGEST_TOPIC", 4000))
    figures += memory_figures(memory_rows)
    embed_images = env_int("PRX_SEMANTIC_EMBED_IMAGES", 12288)
    if embed_images:
        figures += embedding_figures(embed_images)
    report(figures, "semantic")


if __name__ == "__main__":
    main()
