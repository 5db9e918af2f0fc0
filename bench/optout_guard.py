"""Loader: the cost of the opt-out guard (issue 30), as samples/s of one epoch of
`build_dataset` with the guard against the same loader without it (`guard_opt_outs=False`),
over one tree with no sidecars and 1 % of its samples opted out by request files.

Each measurement includes opening the dataset (where the guard reads and resolves the
request files and places the opt-outs through the mapping table) and one epoch yielding
JPEG bytes (the loader's cheapest per-sample path, so the guard's share is largest).
Runs alternate (which goes first swaps each round), five each, ten epochs a run, timed
in this process's CPU seconds (the loader reads local shards in this process, so its CPU
time is its work; wall time on a shared two-core machine moved by ±30 % between identical
runs); the medians are compared, wall-clock rates printed beside them. Target: the guard
costs < 2 %.
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from bench.common import OUT, Figure, release_loader, report
from prx_assets.stages.shards.mds import write_mds_tree
from prx_assets.stages.shards.plan import WriteOptions
from prx_assets.storage.lance_tables import overwrite_rows
from prx_assets.storage.layout import Storage
from prx_assets.testing.mds_corpus import build_corpus, inputs_for

SHAPES = ((1, 64, 64), (1, 48, 80), (1, 80, 48))
PER_SHAPE = 2000
OPTED_SHARE = 0.01
ROUNDS = 5
BATCH = 8
# Epochs per run: the guard's fixed cost (reading ~10 ms of request files and tables when
# the dataset opens) against a realistic stream, not a 0.2 s one.
EPOCHS = 10


def prepare(root: Path) -> int:
    """A tree, raw_images key columns, and request files opting 1 % of the ids out."""
    build_corpus(root, "bench", per_shape=PER_SHAPE, shapes=SHAPES, uncaptioned=0, rejected=0)
    write_mds_tree(inputs_for(root, "bench"), root, "bench",
                   WriteOptions(size_limit=1 << 20, parallel=False), log=lambda _: None)
    ids = sorted(Storage(root).table("mds_samples", "bench").to_table(columns=["id"])
                 .column("id").to_pylist())
    raw = pa.table({"id": ids, "source": ["bench"] * len(ids),
                    "source_key": [i.split(":", 1)[1] for i in ids]})
    overwrite_rows(Storage(root).table("raw_images", "bench"), raw, raw.schema)
    opted = ids[::int(1 / OPTED_SHARE)]
    folder = root / "opt_outs"
    folder.mkdir()
    for n in range(0, len(opted), 10):  # requests arrive in files of ten
        (folder / f"req-{n:05d}.jsonl").write_text("".join(
            json.dumps({"key_type": "id", "value": i, "timestamp": "2026-11-01",
                        "reference": "bench"}) + "\n" for i in opted[n:n + 10]))
    return len(opted)


def epoch(root: Path, guard: bool) -> int:
    from prx_assets.loader import build_dataset
    from prx_assets.testing.shared_memory import release_shared_memory

    release_shared_memory(root)
    dataset = build_dataset(root / "mds", 1, BATCH, weights={"bench": 1.0}, seed=1,
                            decode_images=False, guard_opt_outs=guard)
    count = sum(sum(1 for _ in dataset) for _ in range(EPOCHS))
    release_loader(dataset)
    del dataset
    return count


def bench_guard(work: Path) -> list[Figure]:
    root = work / "data"
    opted = prepare(root)
    rates: dict[bool, list[float]] = {True: [], False: []}
    wall: dict[bool, list[float]] = {True: [], False: []}
    counts: dict[bool, int] = {}
    for round_ in range(ROUNDS):
        for guard in ((False, True) if round_ % 2 == 0 else (True, False)):
            cpu, start = time.process_time(), time.perf_counter()
            counts[guard] = epoch(root, guard)
            rates[guard].append(counts[guard] / (time.process_time() - cpu))
            wall[guard].append(counts[guard] / (time.perf_counter() - start))
    with_guard, without = statistics.median(rates[True]), statistics.median(rates[False])
    print(f"opt-out guard: {opted} of {PER_SHAPE * len(SHAPES)} samples opted out, no "
          f"sidecars; without the guard {counts[False]} samples a run (the opt-outs "
          f"streamed) at {without:.0f}/CPU-s, with it {counts[True]} at {with_guard:.0f}/CPU-s "
          f"(medians of {ROUNDS}): cost {(1 - with_guard / without) * 100:.2f} %; wall-clock "
          f"medians {statistics.median(wall[False]):.0f}/s and "
          f"{statistics.median(wall[True]):.0f}/s")
    return [Figure("loader", "samples/CPU-s, opt-out guard", with_guard,
                   "loader without the guard", without, "sample/s")]


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-optout-", dir=OUT))
    try:
        figures = bench_guard(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(figures, "optout_guard")


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
