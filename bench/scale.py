"""Scale: the whole graph on generated corpora of N/20, N/5 and N JPEGs (default N = 10,000:
500, 2,000 and 10,000; env PRX_SCALE_IMAGES, PRX_SCALE_SMALL, PRX_SCALE_MID, PRX_SCALE_RUNS
to pick runs, e.g. `mid,full`), on the embedded default (`original` captions, embedded
classifier), as `make demo` runs it: `materialize_all` in a fresh process on a fresh data
root and Dagster instance.

1. Throughput and overhead. Baseline: the same per-image kernels the stages call (ingest's
   read + header probe + sha256, the image stage's decode/filter/bucket/Lanczos/Q92/phash,
   the embedded classifier and the caption-derived attributes (attributes' default backend)
   on the captions, the MDS write of the kept samples and the corpus thumbnail) run alone
   in a plain 2-process pool over the same files, i.e. the same parallelism as the
   embedded Ray on this 2-core machine. Per run: end to end (the child process's wall) /
   the kernels' pool wall, target <= 1.25 (stretch 1.10), and a table of each stage's
   Dagster step seconds (STEP_START to STEP_SUCCESS in the run's event log) against its
   kernel seconds, target <= 1.25, and the stage steps together (the wall any of them ran,
   steps side by side once) against the sum of their kernels; checks, global jobs and Ray
   start apart.
2. Memory. Peak RSS, PSS and USS of the whole process tree (driver, GCS, raylet, Ray
   workers, spawned helpers), sampled every 0.5 s from /proc, and the PSS split by process
   kind at the peak (bench/proc_memory.py); ratios between consecutive runs (10k/2k and
   2k/500), target <= 1.3 (memory does not grow with the corpus).
3. Output sizes of the largest run for docs/scale.md: raw bytes, bucketed bytes per tier,
   Lance tables, MDS shards and sidecars, fragment counts.

The corpus is generated once (bench/scale_corpus.py) and reused; data roots live under
bench/out/scale_run/ and are removed after measuring; bench/out/scale_details.json is
rewritten after every run and kernel pass. The 10,000-image run takes tens of minutes on two
cores: PRX_SCALE_IMAGES=1000 is a quick look.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.common import OUT, Figure, cpu_count, report
from bench.core_profile import core_profile, print_core_profile, step_seconds, step_windows
from bench.core_timeline import save_timeline
from bench.proc_memory import CoreUse, Peaks, TreeMemoryMonitor, timeline_cpu_s
from bench.scale_corpus import corpus_profile, generate_corpus, link_subset
from bench.scale_kernels import KernelRun, run_kernels

RUN_DIR = OUT / "scale_run"
SOURCE_NAMES = {"small": "scale_small", "mid": "scale_mid", "full": "scale_full"}
# Each stage's Dagster step and the kernel the baseline times for it (None: `original`
# captions are a join, no kernel); the other steps are checks and global jobs. The
# semantic steps (image_embeddings, semantic duplicates, concepts) are not in this graph:
# materialize_all runs them only when asked (`semantic=True`), as `make demo` does not.
STAGE_KERNELS = {"raw_images": "ingest", "image_stage": "image", "captions": None,
                 "caption_labels": "labels", "attributes": "attributes", "mds_shards": "mds",
                 "corpus": "thumbnail"}
STEP_TARGET = 1.25  # every step / its kernels
END_TO_END_TARGET, END_TO_END_STRETCH = 1.25, 1.10  # child process wall / kernels' pool wall
MEMORY_TARGET = 1.3  # peak PSS of the tree, larger run / smaller run
DAGSTER_YAML = """\
storage:
  sqlite:
    base_dir: {home}/storage
local_artifact_storage:
  module: dagster._core.storage.root
  class: LocalArtifactStorage
  config:
    base_dir: {home}
concurrency:
  pools:
    default_limit: 1
telemetry:
  enabled: false
"""


# ------------------------------------------------------------------------ the pipeline run

@dataclass
class PipelineRun:
    images: int
    seconds: float  # the child process, start to exit (imports, Ray start, every job)
    peaks: Peaks
    child: dict = field(default_factory=dict)  # what the child measured (see child_main)
    timeline: list[CoreUse] = field(default_factory=list)  # the tree's cores, sampled


def write_sources(path: Path, name: str, folder: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"sources:\n  - {{name: {name}, kind: image_folder, uri: {folder}, "
                    f"license: generated}}\n")
    return path


def run_pipeline(sources_file: Path, data_root: Path, images: int) -> PipelineRun:
    """materialize_all in a child process on a fresh data root and instance, with the
    memory of the child's whole process tree sampled while it runs."""
    shutil.rmtree(data_root, ignore_errors=True)
    home = data_root / "dagster_home"
    home.mkdir(parents=True)
    (home / "dagster.yaml").write_text(DAGSTER_YAML.format(home=home))
    result = data_root / "child.json"
    env = {**os.environ, "PRX_DATA_ROOT": str(data_root), "PRX_SOURCES": str(sources_file),
           "DAGSTER_HOME": str(home), "PRX_CAPTIONER": str(data_root / "no-captioner.yaml"),
           "HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}
    command = [sys.executable, "-m", "bench.scale", "--child", str(sources_file), str(result)]
    started = time.perf_counter()
    with open(data_root / "child.log", "w") as log:
        child = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                 cwd=Path(__file__).resolve().parent.parent)
        with TreeMemoryMonitor(child.pid, dump=data_root / "peaks.json") as monitor:
            _, status, usage = os.wait4(child.pid, 0)  # usage: the child and what it reaped
        code = os.waitstatus_to_exitcode(status)
        seconds = time.perf_counter() - started
        # The child's rusage misses Ray's workers (the raylet reaps them, and is not reaped
        # itself) and the last sample misses every process that exited before it: the
        # timeline counts each process over the intervals it lived.
        monitor.peaks.cpu_s = max(monitor.peaks.cpu_s, usage.ru_utime + usage.ru_stime,
                                  timeline_cpu_s(monitor.timeline))
    if code != 0 or not result.exists():
        tail = (data_root / "child.log").read_text()[-3000:]
        raise RuntimeError(f"pipeline child failed ({code}):\n{tail}")
    return PipelineRun(images, seconds, monitor.peaks, json.loads(result.read_text()),
                       monitor.timeline)


def child_main(sources_file: str, result_path: str) -> int:
    """In the child: start Ray (timed apart), run every job as `make demo` does, record
    step timings from the instance's event log."""
    import dagster as dg

    from prx_assets.demo.runner import materialize_all
    from prx_assets.engine import ray_runtime

    started = time.perf_counter()
    ray_runtime.connect()
    ray_s = time.perf_counter() - started
    instance = dg.DagsterInstance.get()
    runs = materialize_all(Path(sources_file), instance)
    materialize_s = time.perf_counter() - started - ray_s
    Path(result_path).write_text(json.dumps({
        "ray_start_s": ray_s, "materialize_s": materialize_s,
        "success": all(r.success for r in runs),
        "failed": [r.source for r in runs if not r.success],
        "checks": {k: v for r in runs for k, v in r.checks.items()},
        "steps": step_seconds(instance, [r.run_id for r in runs]),
        "step_windows": step_windows(instance, [r.run_id for r in runs]),
        "run_seconds": run_seconds(instance, [r.run_id for r in runs]),
    }, indent=2))
    return 0


def run_seconds(instance, run_ids: list[str]) -> dict[str, float]:
    """Wall seconds of each run (its first to its last event), keyed by job name."""
    totals: dict[str, float] = defaultdict(float)
    for run_id in run_ids:
        logs = instance.all_logs(run_id)
        if logs:
            job = instance.get_run_by_id(run_id).job_name
            totals[job] += logs[-1].timestamp - logs[0].timestamp
    return dict(totals)


# -------------------------------------------------------------------------- output sizes

def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def bucketed_bytes(uri: Path) -> tuple[dict[str, int], dict[str, dict]]:
    """Rows per status, and kept images and JPEG bytes per tier (streamed: the image
    column of 10,000 images is gigabytes)."""
    import lance
    import pyarrow.compute as pc

    statuses: Counter = Counter()
    images: Counter = Counter()
    total: Counter = Counter()
    for batch in lance.dataset(str(uri)).to_batches(columns=["status", "tier", "image"],
                                                    batch_size=256):
        statuses.update(batch.column("status").to_pylist())
        lengths = pc.binary_length(batch.column("image")).to_pylist()
        for status, tier, length in zip(batch.column("status").to_pylist(),
                                        batch.column("tier").to_pylist(), lengths,
                                        strict=True):
            if status == "ok":
                images[str(tier)] += 1
                total[str(tier)] += length
    tiers = {tier: {"images": n, "bytes": total[tier], "mean_bytes": total[tier] / n}
             for tier, n in sorted(images.items(), key=lambda kv: int(kv[0]))}
    return dict(statuses), tiers


def output_sizes(data_root: Path, source: str, source_folder: Path) -> dict:
    """Bytes and counts of what the run wrote, for docs/scale.md's projection."""
    from prx_assets.storage.layout import Storage
    from prx_assets.storage.tables import BUCKETED_IMAGES, GLOBAL, PER_SOURCE

    storage = Storage(str(data_root))
    tables = {}
    for name, table_source in [*((n, source) for n in PER_SOURCE), *((n, None) for n in GLOBAL)]:
        ref = storage.table(name, table_source)
        if not ref.exists():
            continue
        table = ref.open()
        uri = Path(ref.uri)
        tables[str(uri.relative_to(data_root / "lance"))] = {
            "rows": table.count_rows(), "bytes": dir_bytes(uri),
            "fragments": len(table.get_fragments())}
    statuses, tiers = bucketed_bytes(Path(storage.table(BUCKETED_IMAGES, source).uri))
    tree = (storage.mds_root / source).path.resolve()
    shards = list(tree.rglob("shard.*.mds"))
    raw_files = list(source_folder.glob("*.jpg"))
    return {
        "source_files": len(raw_files),
        "source_bytes": sum(p.stat().st_size for p in raw_files),
        "statuses": statuses, "tiers": tiers, "tables": tables,
        "mds": {"shards": len(shards), "bytes": sum(p.stat().st_size for p in shards),
                "leaves": len(list(tree.rglob("index.json"))),
                "sidecars": len(list(tree.rglob("shard.*.skip.json"))),
                "sidecar_bytes": sum(p.stat().st_size for p in tree.rglob("shard.*.skip.json"))},
    }


# ------------------------------------------------------------------------------ reporting

def stage_table(run: PipelineRun, kernels: KernelRun) -> list[tuple[str, float, float | None]]:
    """(step, Dagster step seconds, kernel seconds / processes or None) per measured stage."""
    steps = run.child["steps"]
    return [(step, steps.get(step, 0.0),
             None if kernel is None else kernels.per_kernel.get(kernel, 0.0) / kernels.processes)
            for step, kernel in STAGE_KERNELS.items()]


def union_seconds(spans: Iterable[Sequence[float]]) -> float:
    """Wall seconds covered by any of the (start, end) spans (overlaps count once)."""
    covered, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            covered += end - max(start, reach)
            reach = end
    return covered


def stages_together(run: PipelineRun, kernels: KernelRun) -> tuple[float, float]:
    """(wall seconds any stage step ran, the stages' kernel seconds): the issue's "stage
    steps together". Steps side by side (caption_labels and attributes) share the cores as
    the kernels' pool does, so each alone against its own kernel reads about twice what
    the pair costs."""
    windows = run.child.get("step_windows", {})
    spans = [(float(start), float(end)) for step in STAGE_KERNELS
             for start, end in windows.get(step, [])]
    kernel_s = sum(k for _, _, k in stage_table(run, kernels) if k is not None)
    return union_seconds(spans), kernel_s


def other_steps(run: PipelineRun) -> dict[str, float]:
    """The checks' and global jobs' steps (every step without a kernel of its own)."""
    return {k: v for k, v in run.child["steps"].items() if k not in STAGE_KERNELS}


def ratio_text(value: float, baseline: float | None) -> str:
    return f"{value / baseline:6.2f}x" if baseline else "     —"


def print_stages(run: PipelineRun, kernels: KernelRun) -> None:
    print(f"scale: per stage, {run.images:,} images: Dagster step seconds vs kernel seconds "
          f"(summed over the pool / {kernels.processes}); target step / kernel <= "
          f"{STEP_TARGET}")
    print(f"  {'stage':<16} {'step s':>9} {'kernel s':>9} {'ratio':>7}")
    for step, step_s, kernel_s in stage_table(run, kernels):
        kernel_text = f"{kernel_s:9.1f}" if kernel_s is not None else f"{'—':>9}"
        print(f"  {step:<16} {step_s:9.1f} {kernel_text} {ratio_text(step_s, kernel_s)}")
    together, kernel_s = stages_together(run, kernels)
    print(f"  {'stages together':<16} {together:9.1f} {kernel_s:9.1f} "
          f"{ratio_text(together, kernel_s)}  (wall any stage step ran; the pair side by side "
          f"once)")
    others = other_steps(run)
    top = sorted(others.items(), key=lambda kv: -kv[1])[:4]
    print(f"  checks + global jobs {sum(others.values()):.1f} s ("
          + ", ".join(f"{k} {v:.1f}" for k, v in top) + f"); Ray start "
          f"{run.child['ray_start_s']:.1f} s")
    print(f"  end to end (child process) {run.seconds:.1f} s vs kernels' pool "
          f"{kernels.seconds:.1f} s: {ratio_text(run.seconds, kernels.seconds).strip()} "
          f"(target <= {END_TO_END_TARGET}, stretch {END_TO_END_STRETCH}); materialize_all "
          f"{run.child['materialize_s']:.1f} s; runs by job: "
          + ", ".join(f"{k} {v:.1f} s" for k, v in run.child["run_seconds"].items()))


def print_memory(run: PipelineRun) -> None:
    peaks = run.peaks
    print(f"scale: memory, {run.images:,} images: peak RSS {peaks.rss_kb / 1024:.0f} MB, PSS "
          f"{peaks.pss_kb / 1024:.0f} MB, USS {peaks.uss_kb / 1024:.0f} MB over "
          f"{peaks.samples} samples, up to {peaks.max_processes} processes")
    print("  PSS by kind at the peak: " + ", ".join(
        f"{kind} {kb / 1024:.0f}" for kind, kb in peaks.kinds_at_pss_peak.items()) + " MB")
    top = sorted(peaks.at_pss_peak.items(), key=lambda kv: -kv[1])[:6]
    print("  PSS by process name at the peak: "
          + ", ".join(f"{name} {kb / 1024:.0f}" for name, kb in top) + " MB")


def run_figures(run: PipelineRun, kernels: KernelRun) -> list[Figure]:
    """End to end and CPU against the kernels, for one run (ratio = the issue's ratio)."""
    return [Figure("scale", f"{run.images} img end to end s", run.seconds,
                   f"kernels' pool, {kernels.processes} procs", kernels.seconds, "s"),
            cpu_figure(run, kernels)]


def stage_figures(run: PipelineRun, kernels: KernelRun) -> list[Figure]:
    together, kernel_s = stages_together(run, kernels)
    return [Figure("scale", f"{run.images} img {step} s", step_s, "its kernels", kernel_s, "s")
            for step, step_s, kernel_s in stage_table(run, kernels) if kernel_s is not None
            ] + [Figure("scale", f"{run.images} img stage steps together s", together,
                        "the stages' kernels", kernel_s, "s")]


def memory_figures(larger: PipelineRun, smaller: PipelineRun) -> list[Figure]:
    return [Figure("scale", f"peak {kind.upper()} MB, {larger.images} img",
                   getattr(larger.peaks, f"{kind}_kb") / 1024, f"{smaller.images} img",
                   getattr(smaller.peaks, f"{kind}_kb") / 1024, "MB")
            for kind in ("pss", "rss", "uss")]


def cpu_figure(run: PipelineRun, kernels: KernelRun) -> Figure:
    """CPU milliseconds per image: fair on a shared machine, where wall time is not."""
    return Figure("scale", f"{run.images} img CPU ms/img (lower)",
                  1000 * run.peaks.cpu_s / run.images, "kernels",
                  1000 * kernels.cpu_seconds / kernels.images, "ms")


def memory_ratios(larger: PipelineRun, smaller: PipelineRun) -> dict[str, float]:
    return {kind: getattr(larger.peaks, f"{kind}_kb") / getattr(smaller.peaks, f"{kind}_kb")
            for kind in ("pss", "rss", "uss")}


def print_memory_ratio(larger: PipelineRun, smaller: PipelineRun) -> None:
    ratios = memory_ratios(larger, smaller)
    print(f"scale      memory ratio {larger.images:,}/{smaller.images:,}: PSS "
          f"{ratios['pss']:.2f} ({larger.peaks.pss_kb / 1024:.0f} MB against "
          f"{smaller.peaks.pss_kb / 1024:.0f}), RSS {ratios['rss']:.2f}, USS "
          f"{ratios['uss']:.2f} (target <= {MEMORY_TARGET})")


def run_details(run: PipelineRun, kernels: KernelRun | None) -> dict:
    details = {"images": run.images, "seconds": run.seconds, "peaks": asdict(run.peaks),
               "memory_by_kind_mb": {k: v / 1024 for k, v in run.peaks.kinds_at_pss_peak.items()},
               "child": run.child}
    if kernels is not None:
        details["kernels"] = asdict(kernels)
        details["stages"] = [{"step": step, "step_s": step_s, "kernel_s": kernel_s,
                              "ratio": step_s / kernel_s if kernel_s else None}
                             for step, step_s, kernel_s in stage_table(run, kernels)]
        details["end_to_end_ratio"] = run.seconds / kernels.seconds
    return details


def save_details(details: dict) -> None:
    """Everything measured so far (rewritten after each step: a killed run keeps its part)."""
    (OUT / "scale_details.json").write_text(json.dumps(details, indent=2))


# ----------------------------------------------------------------------------------- main

def run_sizes() -> dict[str, int]:
    """The runs to make, label -> images, from PRX_SCALE_IMAGES (the largest; default
    10,000), PRX_SCALE_SMALL / PRX_SCALE_MID (default N/20 and N/5) and PRX_SCALE_RUNS (a
    comma list of small, mid, full; default all three: `mid,full` skips the smallest)."""
    total = int(os.environ.get("PRX_SCALE_IMAGES", "10000"))
    sizes = {"small": int(os.environ.get("PRX_SCALE_SMALL", str(max(1, total // 20)))),
             "mid": int(os.environ.get("PRX_SCALE_MID", str(max(1, total // 5)))),
             "full": total}
    wanted = os.environ.get("PRX_SCALE_RUNS", ",".join(sizes)).replace(" ", "").split(",")
    unknown = set(wanted) - set(sizes)
    if unknown:
        raise SystemExit(f"PRX_SCALE_RUNS: unknown runs {sorted(unknown)}; use {list(sizes)}")
    chosen = {label: n for label, n in sizes.items() if label in wanted}
    if sorted(chosen.values()) != list(chosen.values()):
        raise SystemExit(f"scale: run sizes must grow small < mid < full: {chosen}")
    return chosen


def main() -> list[Figure]:
    sizes = run_sizes()
    total = max(sizes.values())
    processes = min(2, cpu_count())
    corpus = generate_corpus(OUT / "scale_corpus", total, processes)
    profile = corpus_profile(total)
    print(f"scale: corpus {corpus} ({profile}); runs {sizes}")
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    details: dict = {"profile": profile, "sizes": sizes, "runs": {}, "memory_ratios": {}}
    runs: dict[str, PipelineRun] = {}
    kernels: dict[str, KernelRun] = {}
    figures: list[Figure] = []
    covered, previous = 0, None
    for label, images in sizes.items():
        last = label == list(sizes)[-1]
        run = measure_run(label, corpus, images, keep_root=last)
        runs[label] = run
        run.child["core_profile"] = core_profile(run.timeline, run.child["step_windows"])
        save_timeline(label, run.images, run.child["step_windows"], run.timeline)
        print_core_profile(run.child["core_profile"], run.images)
        print_memory(run)
        details["runs"][label] = run_details(run, None)
        if last:
            details["output_sizes"] = measure_output_sizes(label)
        save_details(details)
        # The kernels over files covered..images-1, added to the smaller runs' kernels over
        # the files before them: the same files, each measured once (the 10,000-image
        # baseline is long). A measurement, not an estimate: the sum counts the first
        # segment's pool start-up and model loads only, as one pool would (KernelRun.plus).
        segment = run_kernels(corpus, covered, images, processes, RUN_DIR)
        kernels[label] = segment if previous is None else kernels[previous].plus(segment)
        covered, previous = images, label
        print_stages(run, kernels[label])
        figures += run_figures(run, kernels[label])
        details["runs"][label] = run_details(run, kernels[label])
        save_details(details)
    labels = list(sizes)
    for smaller, larger in itertools.pairwise(labels):
        print_memory_ratio(runs[larger], runs[smaller])
        figures += memory_figures(runs[larger], runs[smaller])
        details["memory_ratios"][f"{larger}/{smaller}"] = memory_ratios(runs[larger],
                                                                         runs[smaller])
    figures += stage_figures(runs[labels[-1]], kernels[labels[-1]])
    report(figures, "scale")
    save_details(details)
    return figures


def measure_output_sizes(label: str) -> dict:
    """The sizes of the largest run's outputs; its data root is removed afterwards."""
    try:
        return output_sizes(RUN_DIR / f"root_{label}", SOURCE_NAMES[label],
                            RUN_DIR / f"src_{label}")
    except Exception as exc:
        print(f"scale: output sizes not measured: {type(exc).__name__}: {exc}")
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        shutil.rmtree(RUN_DIR / f"root_{label}", ignore_errors=True)


def measure_run(label: str, corpus: Path, images: int, keep_root: bool = False) -> PipelineRun:
    source = SOURCE_NAMES[label]
    folder = link_subset(corpus, RUN_DIR / f"src_{label}", images)
    sources = write_sources(RUN_DIR / f"{label}.yaml", source, folder)
    run = run_pipeline(sources, RUN_DIR / f"root_{label}", images)
    if not run.child["success"]:
        print(f"scale: WARNING: the {label} run had failures: {run.child['failed']}")
    if not keep_root:
        shutil.rmtree(RUN_DIR / f"root_{label}", ignore_errors=True)
    return run


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        sys.exit(child_main(sys.argv[2], sys.argv[3]))
    main()
