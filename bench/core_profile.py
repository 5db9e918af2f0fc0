"""Where a run's cores went, step by step: the sampled CPU timeline of the run's process
tree (`bench.proc_memory`) split over the steps' windows from the Dagster event log."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from bench.proc_memory import DRIVER, CoreUse

# A sampling interval counts as "both cores busy" when the run's process tree used at
# least this many cores in it (sampled every 0.5 s, a core is rarely used to 100 %).
BOTH_BUSY_CORES = 1.5


@dataclass
class CoreShare:
    """What the cores did during one step (or outside every step): seconds sampled, the
    tree's mean cores, the share of the time with both busy, the driver's mean cores and
    the mean cores the rest of the machine used meanwhile (other processes: the load)."""

    seconds: float = 0.0
    tree_cpu_s: float = 0.0
    both_busy_s: float = 0.0
    driver_cpu_s: float = 0.0
    others_cpu_s: float = 0.0
    iowait_s: float = 0.0  # the machine's core seconds idle waiting on the disk
    read_mb: float = 0.0  # MB the machine read from disk (page-cache misses)

    def add(self, use: CoreUse, share: float) -> None:
        """`share` of the interval `use` (its overlap with the step)."""
        seconds = share * (use.end - use.start)
        tree = share * sum(use.by_kind.values())
        self.seconds += seconds
        self.tree_cpu_s += tree
        self.both_busy_s += seconds if use.tree_cores >= BOTH_BUSY_CORES else 0.0
        self.driver_cpu_s += share * use.by_kind[DRIVER]
        self.others_cpu_s += max(0.0, share * use.machine_busy_s - tree)
        self.iowait_s += share * use.iowait_s
        self.read_mb += share * use.read_mb

    def row(self) -> dict[str, float]:
        per_s = 1 / self.seconds if self.seconds else 0.0
        return {"seconds": self.seconds, "tree_cpu_s": self.tree_cpu_s,
                "tree_cores": self.tree_cpu_s * per_s,
                "both_busy": self.both_busy_s * per_s, "driver_cores": self.driver_cpu_s * per_s,
                "others_cores": self.others_cpu_s * per_s, "iowait_s": self.iowait_s,
                "read_mb": self.read_mb}


def core_profile(timeline: list[CoreUse], windows: dict[str, list[list[float]]]
                 ) -> dict[str, dict[str, float]]:
    """Per step (and `(outside steps)`: imports, Ray start, run set-up, `(whole run)`):
    the cores the tree used, from the sampled timeline split over the steps' windows."""
    shares: dict[str, CoreShare] = defaultdict(CoreShare)
    for use in timeline:
        length = use.end - use.start
        if length <= 0:
            continue
        covered = 0.0
        for step, spans in windows.items():
            overlap = sum(max(0.0, min(use.end, end) - max(use.start, start))
                          for start, end in spans)
            if overlap:
                shares[step].add(use, overlap / length)
                covered += overlap
        if covered < length:
            shares["(outside steps)"].add(use, (length - covered) / length)
        shares["(whole run)"].add(use, 1.0)
    return {step: share.row() for step, share in shares.items()}


def step_seconds(instance, run_ids: list[str]) -> dict[str, float]:
    """Seconds per step key, STEP_START to STEP_SUCCESS/FAILURE, summed over the runs."""
    return {key: sum(end - start for start, end in spans)
            for key, spans in step_windows(instance, run_ids).items()}


def step_windows(instance, run_ids: list[str]) -> dict[str, list[tuple[float, float]]]:
    """(start, end) wall-clock timestamps of each step key's executions, over the runs."""
    from dagster import DagsterEventType

    kinds = {DagsterEventType.STEP_START, DagsterEventType.STEP_SUCCESS,
             DagsterEventType.STEP_FAILURE}
    windows: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for run_id in run_ids:
        starts = {}
        for entry in instance.all_logs(run_id, of_type=kinds):
            if entry.dagster_event.event_type == DagsterEventType.STEP_START:
                starts[entry.step_key] = entry.timestamp
            elif entry.step_key in starts:
                windows[entry.step_key].append((starts.pop(entry.step_key), entry.timestamp))
    return dict(windows)


def print_core_profile(profile: dict[str, dict], images: int) -> None:
    """The per-step core-utilisation table: what holds one core idle, and where."""
    print(f"scale: cores per step, {images:,} images (tree sampled every 0.5 s; both busy "
          f"= the tree used >= {BOTH_BUSY_CORES} cores; others = the rest of the machine; "
          "iowait = core seconds idle waiting on the disk, read = MB the machine read from "
          "it: page-cache misses)")
    print(f"  {'step':<32} {'wall s':>7} {'CPU s':>7} {'cores':>6} {'both busy':>9} "
          f"{'driver':>7} {'others':>7} {'iowait s':>8} {'read MB':>8}")
    ordered = sorted(profile.items(), key=lambda kv: (kv[0].startswith("("), -kv[1]["seconds"]))
    for step, row in ordered:
        if row["seconds"] < 0.5 and not step.startswith("("):
            continue
        print(f"  {step:<32} {row['seconds']:7.1f} {row['tree_cpu_s']:7.1f} "
              f"{row['tree_cores']:6.2f} {row['both_busy']:8.0%} {row['driver_cores']:7.2f} "
              f"{row['others_cores']:7.2f} {row.get('iowait_s', 0.0):8.1f} "
              f"{row.get('read_mb', 0.0):8.0f}")
