"""Step costs: where the seconds of `raw_images` and `mds_shards` go at N images (default
2,000; env PRX_SCALE_IMAGES), against their kernels measured in the same run.

The scale bench (bench/scale.py) times each step of the whole graph against its kernel;
this one looks inside the two steps whose fixed cost dominates at a few thousand images.
In a fresh child process on a fresh data root and instance (as bench.scale runs the
graph), `source_job` runs `raw_images`, then the image stage and `captions` (untimed:
`mds_shards` reads them), then `mds_shards`. Per profiled step: the Dagster step's wall
(STEP_START to STEP_SUCCESS), and around the step's run (its asset checks included, e.g.
`leaves_stream`'s spawned StreamingDataset process) the driver's CPU and the whole process
tree's CPU (Ray workers and daemons included, from /proc), and a cProfile of the driver
(wall clock) summarised by the project's functions the seconds went to; the profiles are
kept under bench/out/step_costs_<step>.prof for `python -m pstats`. On a loaded machine
compare the CPU columns and the same-run ratios, not walls across runs.

The kernels, in the same child after the steps (same machine load): ingest's read + header
probe + sha256 of every file, and the MDS write of the kept samples from the bucketed
table, as bench.scale's kernels' pool times them, divided by its 2 processes.
"""

from __future__ import annotations

import cProfile
import json
import os
import pstats
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.common import OUT, cpu_count
from bench.core_profile import step_seconds
from bench.proc_memory import sample_tree
from bench.scale import DAGSTER_YAML, write_sources
from bench.scale_corpus import generate_corpus, link_subset
from bench.scale_kernels import KERNEL_CHUNK

RUN_DIR = OUT / "step_costs"
SOURCE = "step_costs"
PROFILED = ("raw_images", "mds_shards")
UPSTREAM = ("bucketed_images", "phashes", "captions")  # mds_shards reads two
TOP = 25  # functions printed per step


def main() -> None:
    images = int(os.environ.get("PRX_SCALE_IMAGES", "2000"))
    corpus = generate_corpus(OUT / "scale_corpus", images, min(2, cpu_count()))
    root = RUN_DIR / "root"
    shutil.rmtree(root, ignore_errors=True)
    home = root / "dagster_home"
    home.mkdir(parents=True)
    (home / "dagster.yaml").write_text(DAGSTER_YAML.format(home=home))
    folder = link_subset(corpus, RUN_DIR / "src", images)
    sources = write_sources(RUN_DIR / "sources.yaml", SOURCE, folder)
    env = {**os.environ, "PRX_DATA_ROOT": str(root), "PRX_SOURCES": str(sources),
           "DAGSTER_HOME": str(home), "PRX_CAPTIONER": str(root / "no-captioner.yaml"),
           "HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}
    result = RUN_DIR / "result.json"
    result.unlink(missing_ok=True)
    with open(RUN_DIR / "child.log", "w") as log:
        code = subprocess.call([sys.executable, "-m", "bench.step_costs", "--child",
                                str(sources), str(result)], env=env, stdout=log,
                               stderr=subprocess.STDOUT, cwd=Path(__file__).parent.parent)
    if code != 0:
        raise SystemExit(f"child failed ({code}):\n"
                         + (RUN_DIR / "child.log").read_text()[-3000:])
    print_result(json.loads(result.read_text()), images)


def print_result(result: dict, images: int) -> None:
    print(f"step_costs: {images:,} images; Ray start {result['ray_start_s']:.1f} s")
    print(f"  {'step':<12} {'step s':>7} {'kernel s':>8} {'ratio':>6} {'driver CPU':>10} "
          f"{'tree CPU':>9} {'kernel CPU':>10}")
    for step in PROFILED:
        s = result["steps"][step]
        kernel = result["kernels"][step]
        print(f"  {step:<12} {s['step_s']:7.2f} {kernel['wall_s']:8.2f} "
              f"{s['step_s'] / kernel['wall_s']:5.1f}x {s['driver_cpu_s']:10.2f} "
              f"{s['tree_cpu_s']:9.2f} {kernel['cpu_s']:10.2f}")
    for step in PROFILED:
        print(f"\n  {step}: driver wall by function (cumulative s, calls), of "
              f"{result['steps'][step]['profiled_s']:.2f} s profiled")
        for name, seconds, calls in result["steps"][step]["top"]:
            print(f"    {seconds:7.2f} {calls:6d}  {name}")


# ------------------------------------------------------------------------------ the child

def child_main(sources_file: str, result_path: str) -> int:
    import dagster as dg

    from prx_assets.definitions import build_defs
    from prx_assets.engine import ray_runtime

    started = time.perf_counter()
    ray_runtime.connect()
    result: dict = {"ray_start_s": time.perf_counter() - started, "steps": {}}
    instance = dg.DagsterInstance.get()
    job = build_defs(Path(sources_file)).resolve_job_def("source_job")

    def execute(assets: tuple[str, ...]) -> str:
        run = job.execute_in_process(instance=instance, partition_key=SOURCE,
                                     asset_selection=[dg.AssetKey(a) for a in assets])
        if not run.success:
            raise RuntimeError(f"{assets} failed")
        return run.run_id

    for step in PROFILED:
        if step == "mds_shards":
            execute(UPSTREAM)
        result["steps"][step] = profiled(step, lambda s=step: execute((s,)), instance)
    result["kernels"] = kernels(Path(sources_file))
    Path(result_path).write_text(json.dumps(result, indent=2))
    return 0


def profiled(step: str, run, instance) -> dict:
    """Run one step under cProfile, with the driver's and the tree's CPU around it."""
    profile = cProfile.Profile()
    tree_before, cpu_before = sample_tree(os.getpid()).cpu_s, time.process_time()
    wall = time.perf_counter()
    profile.enable()
    run_id = run()
    profile.disable()
    wall = time.perf_counter() - wall
    cpu = time.process_time() - cpu_before
    tree = sample_tree(os.getpid()).cpu_s - tree_before
    path = OUT / f"step_costs_{step}.prof"
    profile.dump_stats(path)
    return {"step_s": step_seconds(instance, [run_id]).get(step, 0.0), "profiled_s": wall,
            "driver_cpu_s": cpu, "tree_cpu_s": tree, "top": top_functions(path)}


def top_functions(path: Path) -> list[tuple[str, float, int]]:
    """The project's functions by cumulative seconds (and Lance's, Ray's and Dagster's
    entry points the project calls), the largest first."""
    stats = pstats.Stats(str(path))
    rows = []
    for (file, line, name), (_, calls, _, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
        if "prx_assets" in file or "/lance/" in file or name in ("wait", "get"):
            short = file.split("site-packages/")[-1].split("h48/")[-1]
            rows.append((f"{short}:{line} {name}", cumulative, calls))
    rows.sort(key=lambda r: -r[1])
    return rows[:TOP]


def kernels(sources_file: Path) -> dict:
    """The two steps' kernels, timed as bench.scale's pool times them (seconds summed over
    chunks of `KERNEL_CHUNK` files, divided by its 2 processes)."""
    import lance
    from streaming import MDSWriter

    from prx_assets.stages.ingest.raw_rows import raw_row
    from prx_assets.stages.ingest.readers import read_image_file
    from prx_assets.stages.ingest.sources import SourceSpec, load_sources
    from prx_assets.stages.shards.plan import MDS_COLUMNS
    from prx_assets.storage.layout import Storage

    spec = load_sources(sources_file).get(SOURCE)
    root = Path(spec.uri)
    files = sorted(p.name for p in root.glob("*.jpg"))
    wall, cpu = time.perf_counter(), time.process_time()
    for rel in files:
        raw_row(spec.name, read_image_file(SourceSpec(name=SOURCE, kind="image_folder",
                                                      uri=str(root)), root, rel))
    ingest = {"wall_s": (time.perf_counter() - wall) / 2, "cpu_s": time.process_time() - cpu}
    table = lance.dataset(Storage.from_env().table("bucketed_images", SOURCE).uri)
    kept = table.to_table(columns=["id", "image", "width", "height"],
                          filter="status = 'ok'").to_pylist()
    out = RUN_DIR / "kernel_mds"
    wall, cpu = time.perf_counter(), time.process_time()
    for start in range(0, len(kept), KERNEL_CHUNK):
        shutil.rmtree(out, ignore_errors=True)
        with MDSWriter(columns=MDS_COLUMNS, out=str(out), size_limit=128 << 20,
                       compression=None) as writer:
            for row in kept[start:start + KERNEL_CHUNK]:
                writer.write({"image": row["image"], "caption": "a caption", "id": row["id"],
                              "source": SOURCE, "width": row["width"], "height": row["height"],
                              "original_width": row["width"],
                              "original_height": row["height"], "license": "unknown",
                              "url": "", "license_url": "", "attribution": ""})
    shutil.rmtree(out, ignore_errors=True)
    mds = {"wall_s": (time.perf_counter() - wall) / 2, "cpu_s": time.process_time() - cpu}
    return {"raw_images": ingest, "mds_shards": mds}


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        sys.exit(child_main(sys.argv[2], sys.argv[3]))
    main()
