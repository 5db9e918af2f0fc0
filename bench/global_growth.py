"""The cross-source steps as the corpus grows: pHash `duplicates`, `semantic_duplicates` and
`concepts` at several corpus sizes, spread over four sources.

Per size N, on a fresh data root:

- vectors of 64 dimensions (`synthetic.planted_duplicates`, in blocks of at most 250,000
  rows with topics of their own: 20 % of originals with 1-4 near copies, the planted
  groups), written through the embeddings stage's writer (`write_embeddings`), the rows of
  a block dealt over the sources (so groups span sources);
- random 64-bit pHashes, 10 % of them copies of another row's hash (the planted exact
  groups), written as the images stage's `phashes` rows, with its key index on `id`;
- each step run as its asset runs it (duplicates: the Ray job written through
  `write_dataset_atomically` on the first run, then updated from the changes,
  `dedup.incremental`; semantic_duplicates likewise, updated at its recorded fit after
  the first run, `semdedup_streamed`; concepts streamed, then the new rows assigned to the recorded
  hierarchy while the drift measure allows, `spaces.incremental_concepts`), its
  seconds, the driver's peak PSS and the Ray workers' (busy and idle workers' PSS, the
  object store apart) sampled from /proc;
- recall and precision of the planted groups (pairs of rows sharing a group);
- then 0.1 % new rows in one source and every step again: its seconds as a share of the
  full run's.

Seconds per row and the driver's memory are printed as ratios to the smallest size.
Targets (issue 45): per row <= 1.3 and driver memory <= 1.2 from 10^5 to 10^7, recall and
precision >= 0.95, the +0.1 % rerun <= 5 % of the full run.

    python -m bench.global_growth --sizes 1e5,1e6,1e7
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from bench.common import Figure, report
from bench.proc_memory import StepPeak, available_gib, stop_tree

DEFAULT_SIZES = (2_000, 8_000)  # a smoke run for `make bench`; the note uses 1e5,1e6,1e7
SOURCES = ("s0", "s1", "s2", "s3")
DIM = 64
BLOCK_ROWS = 250_000
TOPIC_SEED = 7_000  # block k's topics: this + k
SAMPLE_ROWS = 100_000  # the fit's sample from 10^5 up (SemDeDup's grows with K past it)
ENCODER = "bench-encoder"
STEPS = ("duplicates", "semantic_duplicates", "concepts")
T = TypeVar("T")


@dataclass
class StepRun:
    seconds: float = 0.0
    cpu_s: float = 0.0  # the process tree's CPU seconds (fairer than wall on a shared box)
    driver_kb: int = 0
    workers_kb: int = 0
    recall: float | None = None
    precision: float | None = None
    rerun_s: float = 0.0
    rerun_cpu_s: float = 0.0
    peak_at: str = ""  # the driver's code at its peak PSS


@dataclass
class SizeRun:
    rows: int
    steps: dict[str, StepRun] = field(default_factory=dict)


def row_id(source: str, row: int) -> str:
    return f"{source}:{row:011d}"


def write_rows(root: Path, start: int, n: int, seed: int, topics_of: int | None = None
               ) -> np.ndarray:
    """Rows [start, start + n) of every table, dealt over the sources; returns each row's
    planted semantic group (-1: none; numbered from `start`). Each block of rows has the
    topics of its own block number, or of block `topics_of` (more of the same content)."""
    from prx_assets.stages.images.stage import PHASH_SCHEMA
    from prx_assets.stages.semantic.embeddings import write_embeddings
    from prx_assets.stages.semantic.synthetic import planted_duplicates
    from prx_assets.storage.key_index import KeyIndexPolicy, refresh_key_index
    from prx_assets.storage.lance_tables import append_rows
    from prx_assets.storage.layout import Storage

    storage = Storage(str(root))
    groups = []
    for block, first in enumerate(range(start, start + n, BLOCK_ROWS)):
        size = min(BLOCK_ROWS, start + n - first)
        data = planted_duplicates(size, dim=DIM, topics=max(10, size // 2_000),
                                  seed=seed * 1000 + block, topic_seed=TOPIC_SEED + (
                                      first // BLOCK_ROWS if topics_of is None else topics_of))
        groups.append(np.where(data.group >= 0, data.group + first, -1))
        hashes = planted_hashes(size, seed * 1000 + block)
        rows = np.arange(first, first + size)
        for k, source in enumerate(SOURCES):
            mine = np.flatnonzero(rows % len(SOURCES) == k)
            ids = pa.array([row_id(source, int(r)) for r in rows[mine]])
            write_embeddings(storage.table("image_embeddings", source), [pa.table({
                "id": ids, "embedding": pa.FixedSizeListArray.from_arrays(
                    pa.array(data.vectors[mine].ravel()), DIM)})], ENCODER, [])
            append_rows(storage.table("phashes", source), phash_rows(
                ids, hashes[mine], data.pixels[mine], PHASH_SCHEMA), PHASH_SCHEMA)
    for source in SOURCES:  # as the image stage keeps it: lookups by id go through it
        refresh_key_index(storage.table("phashes", source), "id", KeyIndexPolicy())
    return np.concatenate(groups)


def write_sources(root: Path, rows: int) -> None:
    """The size's rows (`write_rows`), each row's planted semantic group saved beside them
    (`truth_path`) for the scorer: returned, the groups (8 bytes a row) sat in the measured
    driver through every step, 80 MB of its peak at 10^7 (duplicates' 252 MB, 10^5: 173)."""
    np.save(truth_path(root), write_rows(root, 0, rows, 1))


def truth_path(root: Path) -> Path:
    return root / "planted_groups.npy"


def planted_hashes(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    hashes = rng.integers(-2**63, 2**63 - 1, size=n, dtype=np.int64)
    copies = rng.random(n) < 0.1
    hashes[copies] = rng.choice(hashes[~copies], size=int(copies.sum()))
    return hashes


def phash_rows(ids: pa.Array, hashes: np.ndarray, pixels: np.ndarray, schema: pa.Schema
               ) -> pa.Table:
    columns = {"id": ids, "phash": pa.array(hashes), "pixels": pa.array(pixels),
               "flat": pa.array(np.zeros(len(ids), bool))}
    return pa.table({f.name: columns.get(f.name, pa.nulls(len(ids), f.type))
                     for f in schema}, schema=schema)


def rows_of(ids: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """The bench's row number of each id (`row_id`)."""
    digits = pc.utf8_slice_codeunits(ids, len(SOURCES[0]) + 1)
    return pc.cast(digits, pa.int64()).to_numpy()


def pair_scores(predicted: np.ndarray, truth: np.ndarray) -> tuple[float, float]:
    """(recall, precision) of the pairs of rows sharing a group (-1: in none)."""
    def pairs(labels: np.ndarray) -> int:
        _, counts = np.unique(labels[labels >= 0], return_counts=True)
        return int((counts * (counts - 1) // 2).sum())

    both = (predicted >= 0) & (truth >= 0)
    joint = predicted[both].astype(np.int64) * (int(truth.max()) + 1) + truth[both]
    _, counts = np.unique(joint, return_counts=True)
    common = int((counts * (counts - 1) // 2).sum())
    return common / max(1, pairs(truth)), common / max(1, pairs(predicted))


def predicted_groups(table: pa.Table, column: str, n: int) -> np.ndarray:
    group = np.full(n, -1, np.int64)
    if table.num_rows:
        group[rows_of(table.column("id"))] = table.column(column).to_numpy()
    return group


def run_duplicates(root: Path) -> None:
    """As the asset runs it: updated from the changes when it can, else the Ray job."""
    from prx_assets.stages.dedup.dedup import DUPLICATES_SCHEMA, duplicates_dataset, hash_inputs
    from prx_assets.stages.dedup.incremental import incremental_duplicates, record_inputs
    from prx_assets.storage.lance_tables import FragmentPolicy, write_dataset_atomically
    from prx_assets.storage.layout import Storage

    storage = Storage(str(root))
    inputs, _ = hash_inputs(storage, list(SOURCES))
    target = storage.table("duplicates")
    if incremental_duplicates(inputs, target) is None:
        write_dataset_atomically(duplicates_dataset(inputs), target, FragmentPolicy(),
                                 DUPLICATES_SCHEMA)
        record_inputs(target, inputs)


def run_semantic_duplicates(root: Path) -> None:
    """As the asset runs it: updated at the recorded fit when it can, else a full run."""
    from prx_assets.stages.semantic.semdedup import SemDedupConfig
    from prx_assets.stages.semantic.semdedup_streamed import streamed_semantic_duplicates
    from prx_assets.stages.semantic.semdedup_update import incremental_semantic_duplicates
    from prx_assets.stages.semantic.streamed import Tasks, space_inputs
    from prx_assets.storage.layout import Storage

    storage = Storage(str(root))
    inputs = space_inputs(storage, list(SOURCES), ENCODER)
    out, clusters = storage.table("semantic_duplicates"), storage.table("semantic_clusters")
    config = SemDedupConfig()
    if incremental_semantic_duplicates(inputs, out, clusters, config,
                                       sample_rows=SAMPLE_ROWS) is None:
        streamed_semantic_duplicates(inputs, out, config, Tasks(use_ray=True),
                                     sample_rows=SAMPLE_ROWS, clusters_out=clusters)


def run_concepts(root: Path) -> None:
    from prx_assets.stages.semantic.concepts import DEFAULT_SIZES, effective_sizes
    from prx_assets.stages.semantic.spaces import (
        concepts_tag,
        incremental_concepts,
        streamed_concepts,
    )
    from prx_assets.stages.semantic.streamed import Tasks, space_inputs
    from prx_assets.storage.layout import Storage

    storage = Storage(str(root))
    inputs = space_inputs(storage, list(SOURCES), ENCODER)
    sizes = effective_sizes(DEFAULT_SIZES, inputs.rows)
    tag = concepts_tag(inputs, sizes, 0.5, 0, SAMPLE_ROWS)
    update = incremental_concepts(inputs, storage.table("concepts"), tag, 0)
    if update is not None and update.drift is not None:
        print(f"  concepts update: {update.new_rows:,} rows, drift {update.drift:+.5f}")
    if update is None:
        streamed_concepts(inputs, storage.table("concepts"), sizes, inputs.rows // 2, 0,
                          Tasks(use_ray=True), sample_rows=SAMPLE_ROWS, tag=tag)


RUNNERS: dict[str, Callable[[Path], None]] = {
    "duplicates": run_duplicates, "semantic_duplicates": run_semantic_duplicates,
    "concepts": run_concepts}


def timed_step(name: str, root: Path) -> StepRun:
    from prx_assets.engine.ray_runtime import return_freed_memory

    # What writing the rows left in Arrow's pool and malloc is the bench's, not the step's.
    pa.default_memory_pool().release_unused()
    return_freed_memory()
    with StepPeak() as peak:
        started = time.perf_counter()
        RUNNERS[name](root)
        seconds = time.perf_counter() - started
    return StepRun(seconds, peak.cpu_s, peak.driver_kb, peak.workers_kb, peak_at=peak.peak_at)


def score_duplicates(root: Path, n: int) -> tuple[float, float]:
    """Recall and precision of `duplicates` against the planted exact groups (the rows of
    equal hashes, read back from phashes)."""
    from prx_assets.storage.layout import Storage

    storage = Storage(str(root))
    dups = storage.table("duplicates").open().to_table(columns=["id", "phash"])
    truth = np.full(n, -1, np.int64)
    hashes = [storage.table("phashes", s).open().to_table(columns=["id", "phash"])
              for s in SOURCES]
    table = pa.concat_tables(hashes)
    _, inverse = np.unique(table.column("phash").to_numpy(), return_inverse=True)
    truth[rows_of(table.column("id"))] = inverse
    sizes = np.bincount(inverse)
    truth[sizes[truth] < 2] = -1
    _, found = np.unique(dups.column("phash").to_numpy(), return_inverse=True)
    predicted = np.full(n, -1, np.int64)
    if dups.num_rows:
        predicted[rows_of(dups.column("id"))] = found
    return pair_scores(predicted, truth)


def score_semantic(root: Path, n: int) -> tuple[float, float]:
    from prx_assets.storage.layout import Storage

    semantic = Storage(str(root)).table("semantic_duplicates").open().to_table(
        columns=["id", "group"])
    return pair_scores(predicted_groups(semantic, "group", n), np.load(truth_path(root)))


def apart(fn: Callable[..., T], *args: object) -> T:
    """fn(*args) in a child process: what generating and writing the rows, or scoring them
    (10^7 ids read back), leaves in a process (Python's arenas, Lance's caches) is the
    bench's, not the driver's it measures."""
    context = multiprocessing.get_context("spawn")  # no fork of a process running Ray
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(fn, *args).result()


def measure(rows: int, work: Path, progress: Path | None = None,
            steps: tuple[str, ...] = STEPS) -> SizeRun:
    """The size's figures, each printed (and saved to `progress`) as soon as it is
    measured: a run stopped in a later phase still has them."""
    root = work / f"n{rows}"
    apart(write_sources, root, rows)
    run = SizeRun(rows)
    scorers: dict[str, Callable[[], tuple[float, float]]] = {
        "duplicates": lambda: apart(score_duplicates, root, rows),
        "semantic_duplicates": lambda: apart(score_semantic, root, rows)}
    for name in steps:
        step = run.steps[name] = timed_step(name, root)
        print(f"  {rows:,} rows: {name} {step.seconds:.1f} s, {step.cpu_s:.1f} cpu s, "
              f"driver {step.driver_kb / 1024:.0f} MB (peak at {step.peak_at or '-'}), "
              f"workers {step.workers_kb / 1024:.0f} MB", flush=True)
        if name in scorers:
            step.recall, step.precision = scorers[name]()
            print(f"  {rows:,} rows: {name} recall {100 * step.recall:.1f} %, precision "
                  f"{100 * step.precision:.1f} %", flush=True)
        save_progress(run, progress)
    extra = max(len(SOURCES), rows // 1000)
    # 0.1 % more, dealt over the sources: new samples of the first block's topics
    apart(write_rows, root, rows, extra, 2, 0)
    for name in steps:
        rerun = timed_step(name, root)
        run.steps[name].rerun_s, run.steps[name].rerun_cpu_s = rerun.seconds, rerun.cpu_s
        print(f"  {rows:,} rows +0.1 %: {name} {rerun.seconds:.1f} s", flush=True)
        save_progress(run, progress)
    shutil.rmtree(root, ignore_errors=True)
    return run


def save_progress(run: SizeRun, path: Path | None) -> None:
    if path is not None:
        path.write_text(json.dumps(asdict(run)))


def load_progress(path: Path) -> SizeRun | None:
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    return SizeRun(data["rows"], {k: StepRun(**v) for k, v in data["steps"].items()})


def figures(runs: list[SizeRun]) -> list[Figure]:
    base = runs[0]
    out: list[Figure] = []
    for run in runs:
        at = f"{run.rows:.0e}".replace("+0", "")
        for name in STEPS:
            if name not in run.steps or name not in base.steps:
                continue  # stopped before this step
            step, first = run.steps[name], base.steps[name]
            label = name.replace("semantic_duplicates", "semdedup")
            out.append(Figure("global", f"{label} s/row ×, {at}", step.seconds / run.rows,
                              f"s/row at {base.rows:,}", first.seconds / base.rows, "s/row"))
            out.append(Figure("global", f"{label} cpu s/row ×, {at}", step.cpu_s / run.rows,
                              f"at {base.rows:,}", first.cpu_s / base.rows, "s/row"))
            out.append(Figure("global", f"{label} driver MB, {at}", step.driver_kb / 1024,
                              f"at {base.rows:,}", first.driver_kb / 1024, "MB"))
            out.append(Figure("global", f"{label} workers MB, {at}", step.workers_kb / 1024,
                              f"at {base.rows:,}", first.workers_kb / 1024, "MB"))
            if step.rerun_s:
                out.append(Figure("global", f"{label} +0.1 % rerun, {at}", step.rerun_s,
                                  "full run", step.seconds, "s"))
                out.append(Figure("global", f"{label} +0.1 % cpu, {at}", step.rerun_cpu_s,
                                  "full run", step.cpu_s, "cpu s"))
            if step.recall is not None and step.precision is not None:
                out.append(Figure("global", f"{label} recall, {at}", 100 * step.recall,
                                  "target", 95.0, "%"))
                out.append(Figure("global", f"{label} precision, {at}", 100 * step.precision,
                                  "target", 95.0, "%"))
    return out


def parse_sizes(text: str) -> list[int]:
    return sorted({int(float(part)) for part in text.split(",") if part.strip()})


def measure_fresh(rows: int, work: Path, progress: Path, steps: tuple[str, ...] = STEPS
                  ) -> None:
    """`measure` in this (fresh) process with its own embedded Ray, after a warm-up; its
    figures go to `progress` as they are measured."""
    import ray

    from prx_assets.engine import ray_runtime

    # The watchdog's SIGINT stops it (Ray shut down on the way out), even where the shell
    # started the bench in the background with SIGINT ignored (Python then keeps ignoring).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        ray_runtime.connect(num_cpus=2)
    except Exception:  # Ray gives its node a fixed time to start: a loaded machine can pass it
        ray.shutdown()
        ray_runtime.connect(num_cpus=2)
    try:
        measure(1_000, work, steps=steps)  # Ray's workers start here, not in the figures
        measure(rows, work, progress, steps)
    finally:
        ray.shutdown()


def watched(rows: int, work: Path, min_available_gib: float, steps: tuple[str, ...] = STEPS
            ) -> tuple[SizeRun | None, str]:
    """One size in a fresh driver process, stopped if the machine's available memory falls
    under `min_available_gib`: (what it measured, why it stopped or "")."""
    progress = work / f"progress-{rows}.json"
    context = multiprocessing.get_context("spawn")  # no fork of a process running Ray
    process = context.Process(target=measure_fresh, args=(rows, work, progress, steps))
    process.start()
    stopped = ""
    while process.is_alive():
        process.join(1.0)
        available = available_gib()
        if process.is_alive() and available < min_available_gib:
            stopped = f"stopped by the memory watchdog: {available:.1f} GiB available"
            print(f"  {rows:,} rows: {stopped}", flush=True)
            stop_tree(process)
    if process.exitcode and not stopped:
        stopped = f"its driver exited with {process.exitcode}"
    return load_progress(progress), stopped


def run(sizes: list[int], min_available_gib: float = 0.0, steps: tuple[str, ...] = STEPS
        ) -> list[SizeRun]:
    """Each size in a fresh driver process, as each run of an asset is one: what a size
    left in a driver (Python's arenas, Lance's and Ray's caches) is not the next size's.
    The report holds what a stopped size measured."""
    work = Path(tempfile.mkdtemp(prefix="prx-global-growth-"))
    runs: list[SizeRun] = []
    try:
        for rows in sizes:
            measured, stopped = watched(rows, work, min_available_gib, steps)
            if measured is not None:
                runs.append(measured)
            if stopped:
                print(f"global_growth: {rows:,} rows {stopped}; larger sizes not run",
                      flush=True)
                break
        return runs
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if runs:
            report(figures(runs), "global_growth")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)))
    parser.add_argument("--min-available-gb", type=float, default=2.0,
                        help="stop a size when the machine's available memory falls under "
                             "this (GiB); what it measured is still reported")
    parser.add_argument("--steps", default=",".join(STEPS),
                        help="the steps to run, of " + ", ".join(STEPS))
    args = parser.parse_args(argv if argv is not None else [])
    steps = tuple(n for n in STEPS if n in args.steps.split(","))
    run(parse_sizes(args.sizes), args.min_available_gb, steps)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
