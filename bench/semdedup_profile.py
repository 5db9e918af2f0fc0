"""Where streamed SemDeDup's CPU goes at one size: every task the Ray path runs (the fit,
the routing of each chunk, each bucket's groups) timed in the worker that runs it (its
process CPU seconds: faiss's, BLAS's and Lance's threads included), with cProfile inside
each task when asked, on `bench.global_growth`'s synthetic sources.

    python -m bench.semdedup_profile --sizes 1e5,1e7 [--cprofile] [--dir D]

Per size it prints each task kind's CPU seconds per row and, with `--cprofile`, the
functions that took the most time inside them; the figures are each kind's CPU per row
as a ratio to the smallest size's. The data of each size is kept under `--dir` (written
once, reused by the next call), the semantic tables rewritten per run.
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import global_growth
from bench.common import Figure, report
from bench.global_growth import apart, parse_sizes

KINDS = {"fit": "semdedup_streamed.fit_centroids", "route": "streamed.route_chunk",
         "bucket": "semdedup_streamed.semdedup_bucket"}


def profiled(kind: str, fn: Callable[..., Any], out: str, with_cprofile: bool
             ) -> Callable[..., Any]:
    """`fn` recording its CPU and wall in the process that runs it (a Ray worker: the
    wrapper travels by value, `fn` by reference), one JSON file a call under `out`."""
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        import cProfile

        profile = cProfile.Profile() if with_cprofile else None
        cpu, wall = time.process_time(), time.perf_counter()
        if profile:
            profile.enable()
        try:
            return fn(*args, **kwargs)
        finally:
            if profile:
                profile.disable()
            stem = f"{out}/{kind}-{os.getpid()}-{time.time_ns()}"
            if profile:
                profile.dump_stats(stem + ".prof")
            Path(stem + ".json").write_text(json.dumps({
                "kind": kind, "cpu": time.process_time() - cpu,
                "wall": time.perf_counter() - wall}))
    return wrapper


def instrument(out: Path, with_cprofile: bool) -> None:
    """Wrap the three task functions where the streamed path looks them up."""
    from prx_assets.stages.semantic import semdedup_streamed, streamed

    modules = {"semdedup_streamed": semdedup_streamed, "streamed": streamed}
    for kind, where in KINDS.items():
        module, name = where.split(".")
        original = getattr(modules[module], name)
        setattr(modules[module], name, profiled(kind, original, str(out), with_cprofile))


def by_kind(out: Path) -> dict[str, tuple[int, float, float]]:
    """kind -> (tasks, CPU s, wall s) over the records under `out`."""
    totals: dict[str, tuple[int, float, float]] = {}
    for path in out.glob("*.json"):
        record = json.loads(path.read_text())
        n, cpu, wall = totals.get(record["kind"], (0, 0.0, 0.0))
        totals[record["kind"]] = (n + 1, cpu + record["cpu"], wall + record["wall"])
    return totals


def top_functions(out: Path, kind: str, count: int = 12) -> str:
    files = [str(p) for p in out.glob(f"{kind}-*.prof")]
    if not files:
        return ""
    import io

    text = io.StringIO()
    pstats.Stats(*files, stream=text).strip_dirs().sort_stats("tottime").print_stats(count)
    return "\n".join(line for line in text.getvalue().splitlines()
                     if line.strip() and not line.rstrip().endswith(".prof"))


def profile_size(rows: int, root: Path, out: Path, with_cprofile: bool) -> dict:
    """One full streamed run at `rows` (after a 1,000-row warm-up that starts the workers),
    its tasks recorded under `out`."""
    import ray

    from prx_assets.engine import ray_runtime

    if not global_growth.truth_path(root).exists():
        global_growth.apart(global_growth.write_sources, root, rows)
    for path in (root / "lance").glob("semantic_*"):
        shutil.rmtree(path)
    instrument(out, with_cprofile)
    ray_runtime.connect(num_cpus=2)
    try:
        warm = Path(tempfile.mkdtemp(dir=root.parent)) / "warm"
        global_growth.apart(global_growth.write_sources, warm, 1_000)
        global_growth.run_semantic_duplicates(warm)
        shutil.rmtree(warm.parent)
        for path in out.glob("*"):
            path.unlink()
        started, load = time.perf_counter(), os.getloadavg()[0]
        global_growth.run_semantic_duplicates(root)
        seconds = time.perf_counter() - started
    finally:
        ray.shutdown()
    return {"rows": rows, "seconds": seconds, "load": (load, os.getloadavg()[0])}


def print_size(run: dict, out: Path, with_cprofile: bool) -> dict[str, float]:
    rows = run["rows"]
    kinds = by_kind(out)
    print(f"semdedup_profile: {rows:,} rows, {run['seconds']:.1f} s wall, load "
          f"{run['load'][0]:.1f} -> {run['load'][1]:.1f}")
    kinds["all"] = (sum(n for n, _, _ in kinds.values()), sum(c for _, c, _ in kinds.values()),
                    sum(w for _, _, w in kinds.values()))
    per_row = {}
    for kind in (*KINDS, "all"):
        n, cpu, wall = kinds.get(kind, (0, 0.0, 0.0))
        per_row[kind] = 1e6 * cpu / rows
        print(f"  {kind:<7} {n:>5} tasks  {cpu:8.1f} CPU s  {per_row[kind]:6.1f} us/row  "
              f"(wall in tasks {wall:.1f} s)")
    if with_cprofile:
        for kind in KINDS:
            print(f"  -- {kind}, by own time:\n{top_functions(out, kind)}")
    return per_row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--sizes", default="2000,8000")
    parser.add_argument("--cprofile", action="store_true")
    parser.add_argument("--dir", default="", help="keep each size's data here for reruns")
    args = parser.parse_args(argv if argv is not None else [])
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="prx-semprof-"))
    figures, base = [], None
    try:
        for rows in parse_sizes(args.sizes):
            out = work / f"records-{rows}"
            out.mkdir(parents=True, exist_ok=True)
            run = apart(profile_size, rows, work / f"n{rows}", out, args.cprofile)
            per_row = print_size(run, out, args.cprofile)
            base = base or per_row
            figures += [Figure("global", f"semdedup {kind} cpu/row, {rows:.0e}", per_row[kind],
                               "smallest size", base[kind], "us/row") for kind in per_row]
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    report(figures, "semdedup_profile")


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
