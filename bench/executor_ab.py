"""The jobs' executor with steps at the same time against one step at a time: bench.scale's
pipeline run (materialize_all in a child process, fresh data root and instance, the process
tree's cores sampled) on the same corpus, the two settings alternating (one step, then
concurrent, PRX_AB_ROUNDS times, default 2), so a load that drifts on a shared machine
touches both alike. PRX_SCALE_IMAGES images (default 2,000); PRX_AB_CONCURRENT steps at a
time for the concurrent runs (default the executor's default).

Per run: the child's wall, the materialize part of it, the tree's CPU seconds, the share of
the run with both cores busy, the tree's mean cores, the other processes' mean cores (the
machine's load), the load average at the start, the steps' seconds and how many of them ran
beside another step, and the tree's peak PSS. CPU time and the both-busy share are
steadier than wall on a shared machine. Written to bench/out/executor_ab.json.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass

from bench.common import OUT, cpu_count
from bench.core_profile import core_profile
from bench.scale import (
    RUN_DIR,
    generate_corpus,
    link_subset,
    run_pipeline,
    union_seconds,
    write_sources,
)
from prx_assets.defs.executor import DEFAULT_MAX_CONCURRENT, MAX_CONCURRENT_ENV


@dataclass
class Trial:
    setting: str
    max_concurrent: int
    wall_s: float
    materialize_s: float
    cpu_s: float
    both_busy: float
    tree_cores: float
    others_cores: float
    load_at_start: float
    success: bool
    steps_s: float  # the steps' seconds summed over every job's runs
    overlap_s: float  # of those, seconds during which another step of the run also ran
    peak_pss_mb: float  # the process tree's, at its peak


def trial(setting: str, limit: int, images: int) -> Trial:
    os.environ[MAX_CONCURRENT_ENV] = str(limit)  # the child inherits it
    corpus = generate_corpus(OUT / "scale_corpus", images, min(2, cpu_count()))
    folder = link_subset(corpus, RUN_DIR / "src_ab", images)
    sources = write_sources(RUN_DIR / "ab.yaml", "scale_ab", folder)
    load = os.getloadavg()[0]
    run = run_pipeline(sources, RUN_DIR / "root_ab", images)
    shutil.rmtree(RUN_DIR / "root_ab", ignore_errors=True)
    windows = run.child["step_windows"]
    whole = core_profile(run.timeline, windows)["(whole run)"]
    spans = [span for step_spans in windows.values() for span in step_spans]
    steps_s = sum(end - start for start, end in spans)
    return Trial(setting, limit, run.seconds, run.child["materialize_s"], run.peaks.cpu_s,
                 whole["both_busy"], whole["tree_cores"], whole["others_cores"], load,
                 run.child["success"], steps_s, steps_s - union_seconds(spans),
                 run.peaks.pss_kb / 1024)


def main() -> list[Trial]:
    images = int(os.environ.get("PRX_SCALE_IMAGES", "2000"))
    rounds = int(os.environ.get("PRX_AB_ROUNDS", "2"))
    concurrent = int(os.environ.get("PRX_AB_CONCURRENT", str(DEFAULT_MAX_CONCURRENT)))
    trials = []
    for _ in range(rounds):
        for setting, limit in (("one at a time", 1), ("concurrent", concurrent)):
            trials.append(trial(setting, limit, images))
            print(_line(trials[-1]), flush=True)
            (OUT / "executor_ab.json").write_text(
                json.dumps([asdict(t) for t in trials], indent=2))
    return trials


def _line(t: Trial) -> str:
    return (f"{t.setting:>13} (max {t.max_concurrent}): wall {t.wall_s:6.1f} s, "
            f"materialize {t.materialize_s:6.1f} s, CPU {t.cpu_s:6.1f} s, both busy "
            f"{t.both_busy:5.1%}, tree {t.tree_cores:4.2f} cores, others "
            f"{t.others_cores:4.2f} cores, load {t.load_at_start:4.1f}; steps "
            f"{t.steps_s:6.1f} s, overlapping {t.overlap_s:5.1f} s; peak PSS "
            f"{t.peak_pss_mb:,.0f} MB"
            f"{'' if t.success else ', FAILED'}")


if __name__ == "__main__":
    main()
