"""Incremental reruns and resumed runs, through Dagster materialisations.

On a generated image_folder source (`--images N`, default a small smoke run), with the
project's definitions on an on-disk instance and a fresh data root in a temp folder:

1. a full run of raw_images -> bucketed_images / phashes -> captions -> mds_shards (captions
   from the files' sidecars, backend `original`, so the chain to shards is complete), then
   an unchanged rerun: each step's fixed cost, named apart;
2. +1 % new files and -1 % removed, then the rerun: each step's time as a ratio of the
   full run's (with the run's cost outside its steps and Ray's start-up named apart);
3. the image stage in cold child processes (each its own embedded Ray, as a new run is):
   under new settings (every row to redo) uninterrupted, the baseline; under other new
   settings, held by the failpoint `images.chunk_committed` after its first chunk (half the
   rows) and SIGKILLed, then rerun; then once more with nothing left, the fixed cost the
   second run adds. Work, killed plus rerun, as a ratio of the baseline: rows processed
   (the killed run's committed rows counted from the table) and step seconds.

With `--plus-one`: the whole graph (every job `make demo` runs, checks included) on a cached
partition of `--images`, then one file more: the +1 run end to end against the 60 s target
and the full run (bench/plus_one.py).

The bench measures whatever each stage does: ingest and shards become incremental on
other branches, and their ratios move once they land.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import OUT, Figure, generated_jpegs, report
from bench.core_profile import step_seconds
from bench.proc_memory import BackgroundSampler, cpu_seconds

DEFAULT_IMAGES = 200  # a smoke run; the issue's figures use --images 2000
SIZES = ((640, 480), (800, 600), (600, 800), (1024, 768), (512, 512), (960, 540))
CHAIN = ("raw_images", "bucketed_images", "phashes", "captions", "mds_shards")
IMAGE_ASSETS = ("bucketed_images", "phashes")
STEPS = ("raw_images", "image_stage", "captions", "mds_shards")
DAGSTER_YAML = ("storage:\n  sqlite:\n    base_dir: {home}/storage\n"
                "local_artifact_storage:\n  module: dagster._core.storage.root\n"
                "  class: LocalArtifactStorage\n  config:\n    base_dir: {home}\n"
                "telemetry:\n  enabled: false\n")
BASELINE_SETTINGS = {"jpeg_quality": 90}
KILLED_SETTINGS = {"jpeg_quality": 91}


# ----------------------------------------------------------------------------- the setup

class Setup:
    """The source folder, data root, instance and definitions of one bench run."""

    def __init__(self, tmp: Path, images: int):
        self.tmp, self.images = tmp, images
        self.folder = tmp / "source"
        self.data_root = tmp / "data"
        self.home = tmp / "dagster_home"
        self.home.mkdir(parents=True)
        (self.home / "dagster.yaml").write_text(DAGSTER_YAML.format(home=self.home))
        self.sources = tmp / "sources.yaml"
        self.sources.write_text(f"sources:\n  - {{name: bench, kind: image_folder, "
                                f"uri: {self.folder}, license: generated}}\n")
        self.captioner = tmp / "captioner.yaml"
        self.captioner.write_text("backend: original\n")
        self.pool = generated_jpegs(OUT / "corpus_incremental", images + extra(images),
                                    sizes=SIZES)
        self.folder.mkdir()
        for path in sorted(self.pool.glob("*.jpg"))[:images]:
            self.add(path)

    def add(self, path: Path) -> None:
        """A pool image into the source, hard-linked, with a caption sidecar."""
        target = self.folder / path.name
        try:
            os.link(path, target)
        except OSError:
            shutil.copy(path, target)
        target.with_suffix(".txt").write_text(f"generated picture {path.stem}: soft shapes "
                                              "and gradients on a plain ground")

    def remove(self, name: str) -> None:
        (self.folder / name).unlink()
        (self.folder / name).with_suffix(".txt").unlink()

    def env(self) -> dict:
        return {**os.environ, "PRX_DATA_ROOT": str(self.data_root),
                "DAGSTER_HOME": str(self.home), "HF_HUB_OFFLINE": "1",
                "RAY_USAGE_STATS_ENABLED": "0"}


def extra(images: int) -> int:
    """1 % of the source (at least one file)."""
    return max(1, images // 100)


def open_instance(home: Path):
    import dagster as dg
    from dagster._core.instance.ref import InstanceRef

    return dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(home)))


def job_for(defs, assets):
    import dagster as dg

    return defs.resolve_job_def("source_job").get_subset(
        asset_selection={dg.AssetKey(a) for a in assets}, asset_check_selection=set())


def image_config(settings: dict, chunk_rows: int | None = None) -> dict:
    config = dict(settings) | ({"chunk_rows": chunk_rows} if chunk_rows else {})
    return {"ops": {"image_stage": {"config": config}}}


# ----------------------------------------------------------------------------- measuring

def run_wall(instance, run_id: str) -> float:
    logs = instance.all_logs(run_id)
    return logs[-1].timestamp - logs[0].timestamp if logs else 0.0


def materialized(result) -> dict[str, dict]:
    """Each asset's materialisation metadata (raw values) of an in-process result."""
    out = {}
    for event in result.get_asset_materialization_events():
        mat = event.event_specific_data.materialization
        out[mat.asset_key.path[-1]] = {k: v.value for k, v in mat.metadata.items()}
    return out


class BusyWorkers(BackgroundSampler):
    """The most Ray worker processes seen busy at once (> 50 % of a core) while running:
    a look at whether the image stage's map still runs in parallel."""

    def __init__(self, interval: float = 0.5):
        super().__init__(interval)
        self.most = 0

    def _run(self) -> None:
        # /proc, as bench.proc_memory reads it (psutil is not a dependency).
        before: dict[int, float] = {}
        while not self._stop.wait(self.interval):
            now = {pid: cpu_seconds(pid) for pid in ray_worker_pids()}
            busy = sum(now[pid] - before[pid] > 0.5 * self.interval
                       for pid in now if pid in before)
            before = now
            self.most = max(self.most, busy)


def ray_worker_pids() -> list[int]:
    """Processes titled `ray::...` (Ray workers and actors)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "cmdline").read_bytes().startswith(b"ray::"):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


class Runner:
    """In-process runs on the bench's instance, each measured step by step."""

    def __init__(self, setup: Setup):
        from prx_assets.definitions import build_defs

        self.setup = setup
        os.environ["PRX_DATA_ROOT"] = str(setup.data_root)
        self.instance = open_instance(setup.home)
        self.defs = build_defs(setup.sources, setup.captioner)

    def run(self, assets, run_config: dict | None = None) -> dict:
        started = time.perf_counter()
        result = job_for(self.defs, assets).execute_in_process(
            partition_key="bench", instance=self.instance, run_config=run_config,
            raise_on_error=False)
        if not result.success:
            raise RuntimeError(f"run {result.run_id} failed")
        steps = step_seconds(self.instance, [result.run_id])
        wall = run_wall(self.instance, result.run_id)
        return {"steps": steps, "wall": wall, "outside_steps": wall - sum(steps.values()),
                "call_s": time.perf_counter() - started, "meta": materialized(result)}


# ----------------------------------------------------------------------------- runs in a child

def child_run(setup: Setup, instance, settings: dict, chunk_rows: int | None = None,
              kill_after_first_chunk: bool = False) -> dict:
    """The image stage alone in a child process (cold, as a new run is: its own embedded
    Ray), on the shared instance; with `kill_after_first_chunk`, held by the failpoint
    `images.chunk_committed` and SIGKILLed there (its whole process group). Returns the
    run id and the image stage's seconds (to the kill, for a killed run)."""
    from dagster import DagsterEventType

    from prx_assets.storage import failpoints

    marker = setup.tmp / f"failpoint-{time.time_ns()}.json"
    env = setup.env()
    env.pop("RAY_ADDRESS", None)
    if kill_after_first_chunk:
        env |= failpoints.env("images.chunk_committed", marker)
    log_path = setup.tmp / f"child-{time.time_ns()}.log"
    with open(log_path, "w") as log:
        child = subprocess.Popen(
            [sys.executable, "-m", "bench.incremental", "--child", str(setup.sources),
             str(setup.captioner), json.dumps(image_config(settings, chunk_rows))],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            cwd=Path(__file__).resolve().parent.parent)
        try:
            if kill_after_first_chunk:
                while failpoints.read_marker(marker) is None:  # no run ends without passing
                    if child.poll() is not None:
                        raise RuntimeError("the run ended before its failpoint:\n"
                                           + log_path.read_text()[-3000:])
                    time.sleep(0.05)
                ended = time.time()
            else:
                child.wait()
        finally:
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
            from prx_assets.testing.processes import wait_for_group_gone

            wait_for_group_gone(child.pid)  # Ray workers exit after their raylet
    output = log_path.read_text()
    if "RUN " not in output:
        raise RuntimeError(f"the child printed no run id:\n{output[-3000:]}")
    run_id = output.split("RUN ", 1)[1].split()[0]
    if kill_after_first_chunk:
        start = next(e.timestamp for e in instance.all_logs(
            run_id, of_type=DagsterEventType.STEP_START) if e.step_key == "image_stage")
        run = instance.get_run_by_id(run_id)
        if run is not None and not run.is_finished:
            instance.report_run_failed(run, "SIGKILLed by the incremental bench")
        return {"run_id": run_id, "image_stage_s": ended - start}
    if "SUCCESS True" not in output:
        raise RuntimeError(f"child run {run_id} failed:\n{output[-3000:]}")
    processed = _bucketed_processed(instance, run_id)
    return {"run_id": run_id, "image_stage_s": step_seconds(instance, [run_id])["image_stage"],
            "processed": processed}


def _bucketed_processed(instance, run_id: str) -> int:
    from dagster import DagsterEventType

    for record in instance.get_records_for_run(
            run_id, of_type=DagsterEventType.ASSET_MATERIALIZATION).records:
        materialization = record.event_log_entry.asset_materialization
        if materialization.asset_key.path[-1] == "bucketed_images":
            return int(materialization.metadata["rows_processed"].value)
    raise RuntimeError(f"run {run_id} materialised no bucketed_images")


def rows_made_under(setup: Setup, settings: dict) -> int:
    """bucketed_images rows made under these settings (what a killed run committed)."""
    import lance

    from prx_assets.defs.images import ImageStageConfig
    from prx_assets.stages.images.stage import settings_fingerprint
    from prx_assets.storage.filters import eq_filter

    fingerprint = settings_fingerprint(ImageStageConfig(**settings).options())
    table = lance.dataset(str(setup.data_root / "lance/bucketed_images/bench.lance"))
    return table.count_rows(filter=eq_filter("settings", fingerprint))


def child_main(sources: str, captioner: str, run_config: str) -> int:
    """In the child: the image stage alone, with `run_config`, on the shared instance."""
    import uuid

    from prx_assets.definitions import build_defs

    run_id = str(uuid.uuid4())
    print(f"RUN {run_id}", flush=True)
    result = job_for(build_defs(Path(sources), Path(captioner)), IMAGE_ASSETS) \
        .execute_in_process(partition_key="bench",
                            instance=open_instance(Path(os.environ["DAGSTER_HOME"])),
                            run_id=run_id, run_config=json.loads(run_config),
                            raise_on_error=False)
    print(f"SUCCESS {result.success}", flush=True)
    return 0


# ----------------------------------------------------------------------------- the bench

def measure(images: int) -> list[Figure]:
    from prx_assets.engine import ray_runtime

    tmp = Path(tempfile.mkdtemp(prefix="bench-incremental-"))
    try:
        setup = Setup(tmp, images)
        started = time.perf_counter()
        ray_runtime.connect()
        ray_start = time.perf_counter() - started
        runner = Runner(setup)
        with BusyWorkers() as busy:
            full = runner.run(CHAIN)
        noop = runner.run(CHAIN)  # nothing changed: each step's fixed cost
        pool = sorted(setup.pool.glob("*.jpg"))
        for path in pool[images:images + extra(images)]:  # +1 %
            setup.add(path)
        for path in pool[:extra(images)]:  # -1 %
            setup.remove(path.name)
        rerun = runner.run(CHAIN)
        # Kill and resume, each run a cold child process; the baseline too.
        instance = runner.instance
        baseline = child_run(setup, instance, BASELINE_SETTINGS)
        rows = baseline["processed"]
        killed = child_run(setup, instance, KILLED_SETTINGS, chunk_rows=math.ceil(rows / 2),
                           kill_after_first_chunk=True)
        killed["committed"] = rows_made_under(setup, KILLED_SETTINGS)
        resumed = child_run(setup, instance, KILLED_SETTINGS)
        idle = child_run(setup, instance, KILLED_SETTINGS)  # nothing left: a cold run's cost
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return print_figures(images, ray_start, full, noop, rerun,
                         {"baseline": baseline, "killed": killed, "resumed": resumed,
                          "idle": idle}, busy.most)


def print_figures(images: int, ray_start: float, full: dict, noop: dict, rerun: dict,
                  kill: dict, busy_workers: int) -> list[Figure]:
    print(f"incremental bench: {images} images, then +{extra(images)} / -{extra(images)}; "
          f"Ray start {ray_start:.1f} s (once per process)")
    print(f"  run cost outside its steps: full {full['outside_steps']:.1f} s, rerun "
          f"{rerun['outside_steps']:.1f} s; image stage busy Ray workers (max, > 50 % CPU): "
          f"{busy_workers}")
    figures = []
    for step in STEPS:
        full_s, rerun_s = full["steps"].get(step, 0.0), rerun["steps"].get(step, 0.0)
        fixed = noop["steps"].get(step, 0.0)
        print(f"  {step}: full {full_s:.1f} s, rerun {rerun_s:.1f} s, of which fixed cost "
              f"(an unchanged rerun) {fixed:.1f} s; rerun minus fixed "
              f"{max(0.0, rerun_s - fixed):.1f} s = "
              f"{max(0.0, rerun_s - fixed) / full_s if full_s else float('nan'):.3f}x full")
        figures.append(Figure(step, "rerun step s (+1%/-1%)", rerun_s, "full run", full_s, "s"))
    for asset in ("raw_images", "bucketed_images", "phashes", "captions", "mds_shards"):
        m = rerun["meta"].get(asset, {})
        if "rows_processed" in m:
            print(f"  rerun {asset}: processed {m['rows_processed']}, reused "
                  f"{m['rows_reused']}, removed {m['rows_removed']}")
    baseline, killed, resumed, idle = (kill[k] for k in ("baseline", "killed", "resumed",
                                                         "idle"))
    rows = baseline["processed"]
    print(f"  kill at 50 %: the killed run committed {killed['committed']} of {rows} rows in "
          f"{killed['image_stage_s']:.1f} s before the kill; the rerun did "
          f"{resumed['processed']} in {resumed['image_stage_s']:.1f} s; uninterrupted "
          f"{baseline['image_stage_s']:.1f} s; a cold run with nothing to do "
          f"{idle['image_stage_s']:.1f} s (the second run's fixed cost)")
    figures.append(Figure("images", "killed+rerun rows processed",
                          killed["committed"] + resumed["processed"], "one uninterrupted run",
                          rows, "rows"))
    both = killed["image_stage_s"] + resumed["image_stage_s"]
    figures.append(Figure("images", "killed+rerun step s", both, "one uninterrupted run",
                          baseline["image_stage_s"], "s"))
    figures.append(Figure("images", "killed+rerun - fixed s", both - idle["image_stage_s"],
                          "one uninterrupted run", baseline["image_stage_s"], "s"))
    return figures


def main(argv: list[str] | None = None) -> list[Figure]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int,
                        default=int(os.environ.get("PRX_INCREMENTAL_IMAGES", DEFAULT_IMAGES)))
    parser.add_argument("--plus-one", action="store_true",
                        help="the whole graph on a cached partition of --images, then +1 file "
                             "(bench/plus_one.py)")
    parser.add_argument("--rebuild", action="store_true",
                        help="with --plus-one: build the partition again, not from its cache")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv if argv is not None else [])
    if args.child:
        sys.exit(child_main(*args.child))
    if args.plus_one:
        from bench import plus_one

        figures = plus_one.measure(args.images, rebuild=args.rebuild)
        report(figures, "plus_one")
        return figures
    figures = measure(args.images)
    report(figures, "incremental")
    return figures


if __name__ == "__main__":
    main(sys.argv[1:])
