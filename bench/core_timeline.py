"""What held the cores when, in one bench.scale run: its saved timeline
(`bench/out/scale_timeline_<label>.json`, written by bench.scale) printed in bins of a few
seconds (the tree's cores, the driver's, the machine's cores idle on the disk (iow), the
busiest Ray tasks, the steps running), then
each step's Ray tasks by CPU seconds. A bin under 1.5 cores with one step running is a
serial phase of that step.

    python -m bench.core_timeline [label] [bin seconds]   # default: full, 2
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

from bench.common import OUT
from bench.core_profile import BOTH_BUSY_CORES
from bench.proc_memory import DRIVER, CoreUse

TOP_TASKS = 2  # tasks named per bin


def timeline_path(label: str) -> Path:
    return OUT / f"scale_timeline_{label}.json"


def save_timeline(label: str, images: int, step_windows: dict, timeline: list[CoreUse]
                  ) -> Path:
    """A run's sampled cores (each interval's CPU by process kind and by busy task) and
    its steps' windows, for `main` to print."""
    path = timeline_path(label)
    path.write_text(json.dumps({"images": images, "step_windows": step_windows,
                                "timeline": [asdict(use) for use in timeline]}))
    return path

TOP_STEP_TASKS = 4  # tasks named per step


def overlap(start: float, end: float, spans: list[list[float]]) -> float:
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in spans)


def bins(timeline: list[dict], width: float) -> list[dict]:
    """The timeline summed into bins of `width` seconds from its first sample: wall, tree
    and driver CPU, the machine's iowait, CPU per task."""
    if not timeline:
        return []
    origin = timeline[0]["start"]
    out: dict[int, dict] = {}
    for use in timeline:
        index = int((use["start"] - origin) // width)
        row = out.setdefault(index, {"start": origin + index * width, "wall": 0.0, "cpu": 0.0,
                                     "driver": 0.0, "iowait": 0.0, "tasks": defaultdict(float)})
        row["wall"] += use["end"] - use["start"]
        row["cpu"] += sum(use["by_kind"].values())
        row["driver"] += use["by_kind"].get(DRIVER, 0.0)
        row["iowait"] += use.get("iowait_s", 0.0)
        for task, cpu in use.get("by_task", {}).items():
            row["tasks"][task] += cpu
    return [out[i] for i in sorted(out)]


def short(name: str) -> str:
    return name.removeprefix("ray::")[:40]


def print_bins(data: dict, width: float) -> None:
    windows, origin = data["step_windows"], data["timeline"][0]["start"]
    print(f"{'t s':>6} {'cores':>5} {'drv':>4} {'iow':>4}  {'tasks (CPU s)':<60} steps")
    for row in bins(data["timeline"], width):
        end = row["start"] + row["wall"]
        steps = [step for step, spans in windows.items()
                 if overlap(row["start"], end, spans) > 0.1 * row["wall"]]
        top = sorted(row["tasks"].items(), key=lambda kv: -kv[1])[:TOP_TASKS]
        tasks = ", ".join(f"{short(t)} {cpu:.1f}" for t, cpu in top)
        flag = "" if row["cpu"] / max(row["wall"], 1e-9) >= BOTH_BUSY_CORES else "*"
        print(f"{row['start'] - origin:6.0f} {row['cpu'] / max(row['wall'], 1e-9):5.2f}"
              f"{flag:1} {row['driver'] / max(row['wall'], 1e-9):4.2f} "
              f"{row['iowait'] / max(row['wall'], 1e-9):4.2f}  {tasks:<60} "
              + ", ".join(steps))


def print_step_tasks(data: dict) -> None:
    """Per step (by start): its wall, and the Ray tasks' and driver's CPU in its window."""
    windows = data["step_windows"]
    print("\nper step: CPU s of the driver and of each Ray task in the step's window "
          "(shared with any step beside it)")
    for step, spans in sorted(windows.items(), key=lambda kv: kv[1][0][0]):
        wall = sum(b - a for a, b in spans)
        if wall < 1.0:
            continue
        tasks: dict[str, float] = defaultdict(float)
        driver = 0.0
        for use in data["timeline"]:
            length = use["end"] - use["start"]
            share = overlap(use["start"], use["end"], spans) / length if length > 0 else 0
            if not share:
                continue
            driver += share * use["by_kind"].get(DRIVER, 0.0)
            for task, cpu in use.get("by_task", {}).items():
                tasks[task] += share * cpu
        top = sorted(tasks.items(), key=lambda kv: -kv[1])[:TOP_STEP_TASKS]
        print(f"  {step:<36} {wall:6.1f} s  driver {driver:5.1f}  "
              + ", ".join(f"{short(t)} {cpu:.1f}" for t, cpu in top))


def process_totals(timeline: list[dict]) -> dict[str, float]:
    """CPU seconds per process title over the whole run (`proc_memory.process_title`)."""
    totals: dict[str, float] = defaultdict(float)
    for use in timeline:
        for title, cpu in use.get("by_process", {}).items():
            totals[title] += cpu
    return dict(totals)


def print_process_totals(data: dict, top: int = 14) -> None:
    totals = process_totals(data["timeline"])
    whole = sum(totals.values()) or 1.0
    print("whole run: CPU s per process title (the tree's; busy workers by their task)")
    for title, cpu in sorted(totals.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {short(title):<44} {cpu:7.1f}  {100 * cpu / whole:4.1f} %")


def main(label: str = "full", width: float = 2.0) -> None:
    data = json.loads(timeline_path(label).read_text())
    print(f"core timeline, {data['images']:,} images, bins of {width:g} s "
          f"(* = under {BOTH_BUSY_CORES} cores)")
    print_bins(data, width)
    print_step_tasks(data)
    print_process_totals(data)


if __name__ == "__main__":
    main(*(sys.argv[1:2] or ["full"]), *(float(a) for a in sys.argv[2:3]))
