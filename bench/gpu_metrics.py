"""What `bench.gpu` measures around the stages: the GPUs (utilisation and memory, as NVML
reports them through one long-running `nvidia-smi` on a thread), the CPU seconds of the
process tree by group (read from /proc), and the timeline of committed chunks (time to the
first result, the steady rate after it).

Steady state runs from the first commit to the last: the model has started and the feed is
full, so the rate compares with PRX's per-GPU figures; the time to the first commit (engine
start, first batch, first Lance commit) is reported apart.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.proc_memory import (
    BUSY,
    CONTROL,
    DRIVER,
    IDLE,
    command_line,
    cpu_seconds,
    descendants,
    process_kind,
)

SMI_QUERY = "index,utilization.gpu,memory.used,memory.total"
# CPU groups of the process tree. `model` is where the model computes: vLLM's engine core
# (its scheduler and the GPU kernel launches) on a GPU; the model actor on the CPU. The feed
# is everything else: Lance reads, JPEG decoding, the ray.data.llm CPU stages, vLLM's front
# end (image processor, detokenizer) in the engine actor, MiniLM, the driver's commits.
MODEL, RAY_WORKERS, RAY_CONTROL, OTHER = "model", "ray workers", "ray control", "other"
GROUPS = (DRIVER, MODEL, RAY_WORKERS, RAY_CONTROL, OTHER)
# vLLM titles its engine core process "VLLM::EngineCore_DP0" (/proc's comm cuts it at 15).
ENGINE_CORE_MARKERS = ("enginecor",)


@dataclass(frozen=True)
class GpuReading:
    t: float  # perf_counter when read
    index: int
    util_pct: float  # share of the last sample period a kernel ran (NVML)
    memory_used_mib: float
    memory_total_mib: float


def gpu_inventory() -> list[str]:
    """`nvidia-smi -L`'s lines (one per GPU); none without a driver or a GPU."""
    listed = smi_output(["-L"]) or ""
    return [line.strip() for line in listed.splitlines() if line.startswith("GPU ")]


def software_versions() -> dict[str, str | None]:
    """The releases a figure depends on (None: not installed here)."""
    import importlib.metadata
    import platform

    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("vllm", "torch", "torchvision", "transformers", "ray"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    try:
        import torch

        versions["cuda"] = torch.version.cuda  # the CUDA torch was built for; None: a CPU build
    except ImportError:
        versions["cuda"] = None
    return versions


def gpu_details() -> dict[str, object]:
    """The driver, the CUDA it supports and each GPU's model, as nvidia-smi reports them
    (empty without a driver)."""
    listed = smi_output(["--query-gpu=name,driver_version,memory.total",
                         "--format=csv,noheader,nounits"])
    header = smi_output([])
    if listed is None:
        return {"driver": None, "driver_cuda": None, "gpu_models": []}
    return parse_gpu_details(listed, header or "")


def smi_output(args: list[str]) -> str | None:
    """`nvidia-smi ARGS`'s output; None without a driver or a GPU."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        run = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True,
                             timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return run.stdout if run.returncode == 0 else None


def parse_gpu_details(listed: str, header: str) -> dict[str, object]:
    """`name, driver_version, memory.total` CSV lines and nvidia-smi's banner (which names
    the newest CUDA the driver supports)."""
    import re

    rows = [[part.strip() for part in line.split(",")] for line in listed.splitlines()
            if line.count(",") == 2]
    cuda = re.search(r"CUDA Version:\s*([0-9.]+)", header)
    return {"driver": rows[0][1] if rows else None,
            "driver_cuda": cuda.group(1) if cuda else None,
            "gpu_models": [f"{name} ({memory} MiB)" for name, _, memory in rows]}


def parse_smi_line(line: str, t: float) -> GpuReading | None:
    """One CSV line of SMI_QUERY (noheader, nounits); None for anything else."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 4:
        return None
    try:
        index, util = int(parts[0]), float(parts[1])
        used, total = float(parts[2]), float(parts[3])
    except ValueError:  # "[N/A]" and the like
        return None
    return GpuReading(t, index, util, used, total)


class GpuSampler:
    """`nvidia-smi` in loop mode, its readings collected on a thread until the block ends."""

    def __init__(self, interval_ms: int = 500):
        self.interval_ms = interval_ms
        self.readings: list[GpuReading] = []
        self.process: subprocess.Popen[str] | None = None
        self._thread = threading.Thread(target=self._read, daemon=True)

    def __enter__(self) -> GpuSampler:
        self.process = subprocess.Popen(
            ["nvidia-smi", f"--query-gpu={SMI_QUERY}", "--format=csv,noheader,nounits",
             f"--loop-ms={self.interval_ms}"], stdout=subprocess.PIPE, text=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)
        self._thread.join(timeout=10)

    def _read(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        for line in self.process.stdout:
            reading = parse_smi_line(line, time.perf_counter())
            if reading is not None:
                self.readings.append(reading)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def wait_for_free_memory(self, gpus: int, timeout_s: float = 120.0,
                             share: float = 0.1) -> float:
        """Seconds until every GPU of the first `gpus` holds under `share` of its memory (the
        last engine's process gone), at most `timeout_s`."""
        started = time.perf_counter()
        while time.perf_counter() - started < timeout_s:
            latest = {r.index: r for r in self.readings[-4 * max(1, gpus):]}
            if len(latest) >= gpus and all(
                    r.memory_used_mib < share * r.memory_total_mib
                    for i, r in latest.items() if i < gpus):
                break
            time.sleep(self.interval_ms / 1000)
        return time.perf_counter() - started


def gpu_figures(readings: list[GpuReading], gpus: int, steady: tuple[float, float],
                stage: tuple[float, float]) -> dict[str, float | int | None] | None:
    """Mean utilisation over the steady window, peak memory over the whole stage, of the
    GPUs the stage used; None without readings."""
    used = [r for r in readings if r.index < gpus]
    in_steady = [r for r in used if steady[0] <= r.t <= steady[1]]
    in_stage = [r for r in used if stage[0] <= r.t <= stage[1]]
    if not in_stage:
        return None
    return {
        "util_mean_pct": round(sum(r.util_pct for r in in_steady) / len(in_steady), 1)
        if in_steady else None,
        "util_samples": len(in_steady),
        "memory_peak_mib": max(r.memory_used_mib for r in in_stage),
        "memory_total_mib": max(r.memory_total_mib for r in in_stage),
    }


# --- CPU of the process tree --------------------------------------------------------------

def cpu_group(pid: int, root: int, name: str, cmdline: str,
              model_markers: tuple[str, ...]) -> str:
    """The group of one process of the tree under `root` (the bench's driver)."""
    if pid == root:
        return DRIVER
    text = f"{name} {cmdline}".lower()
    if any(marker.lower() in text for marker in model_markers):
        return MODEL
    kind = process_kind(pid, root, name, cmdline)
    if kind == CONTROL:
        return RAY_CONTROL
    return RAY_WORKERS if kind in (BUSY, IDLE) else OTHER


def process_name(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "comm").read_text().strip()
    except OSError:
        return ""


@dataclass
class CpuSnapshot:
    """CPU seconds so far of every process in the tree, with its group."""

    t: float
    by_pid: dict[int, tuple[str, float, str]] = field(default_factory=dict)  # group, s, name

    def names(self) -> dict[str, list[str]]:
        """The process names of each group (to check the grouping in a run's JSON)."""
        found: dict[str, set[str]] = defaultdict(set)
        for group, _, name in self.by_pid.values():
            found[group].add(name)
        return {group: sorted(found[group]) for group in GROUPS}


def cpu_snapshot(root: int, model_markers: tuple[str, ...],
                 exclude: frozenset[int] = frozenset()) -> CpuSnapshot:
    snapshot = CpuSnapshot(time.perf_counter())
    for pid in descendants(root):
        if pid in exclude:
            continue
        name = process_name(pid)
        group = cpu_group(pid, root, name, command_line(pid), model_markers)
        snapshot.by_pid[pid] = (group, cpu_seconds(pid), name)
    return snapshot


def cpu_cores(before: CpuSnapshot, after: CpuSnapshot) -> dict[str, float]:
    """Cores busy per group between two snapshots (CPU seconds over wall seconds). A process
    that ended in between takes its last seconds with it; one that started counts whole."""
    wall = after.t - before.t
    seconds: dict[str, float] = defaultdict(float)
    for pid, (group, cpu, _) in after.by_pid.items():
        earlier = before.by_pid.get(pid)
        seconds[group] += cpu - (earlier[1] if earlier else 0.0)
    return {group: round(max(0.0, seconds[group]) / wall, 3) if wall > 0 else 0.0
            for group in GROUPS}


# --- the timeline of one stage ------------------------------------------------------------

class StageCut(Exception):
    """Raised from a commit callback to end a stage at its time cap (commits so far kept)."""


@dataclass
class StageClock:
    """When a stage started and committed, with CPU snapshots at its first and last commit."""

    name: str
    root: int
    model_markers: tuple[str, ...]
    cap_s: float  # after the first commit; the stage is cut past it
    exclude: frozenset[int] = frozenset()
    started: float = 0.0
    ended: float = 0.0
    marks: list[tuple[float, int]] = field(default_factory=list)
    cpu_start: CpuSnapshot | None = None
    cpu_first: CpuSnapshot | None = None
    cpu_last: CpuSnapshot | None = None
    cut: bool = False

    def start(self) -> None:
        self.cpu_start = cpu_snapshot(self.root, self.model_markers, self.exclude)
        self.started = time.perf_counter()

    def mark(self, rows: int) -> None:
        snapshot = cpu_snapshot(self.root, self.model_markers, self.exclude)
        self.marks.append((snapshot.t, rows))
        if self.cpu_first is None:
            self.cpu_first = snapshot
        self.cpu_last = snapshot
        if snapshot.t - self.marks[0][0] > self.cap_s:
            self.cut = True
            raise StageCut(f"{self.name}: past {self.cap_s:.0f} s after its first result")

    def end(self) -> None:
        self.ended = time.perf_counter()
        if self.cpu_last is None:  # no commit at all: the whole stage is the window
            self.cpu_last = cpu_snapshot(self.root, self.model_markers, self.exclude)

    @property
    def steady(self) -> tuple[float, int] | None:
        """(seconds, rows) from the first commit to the last; None with fewer than two."""
        if len(self.marks) < 2:
            return None
        (t0, n0), (t1, n1) = self.marks[0], self.marks[-1]
        return t1 - t0, n1 - n0

    def steady_window(self) -> tuple[float, float]:
        if self.steady is None:
            return self.started, self.ended
        return self.marks[0][0], self.marks[-1][0]

    def cores(self) -> dict[str, float]:
        """Cores per group over the steady window (the whole stage without one)."""
        before = self.cpu_first if self.steady is not None else self.cpu_start
        if before is None or self.cpu_last is None:
            return dict.fromkeys(GROUPS, 0.0)
        return cpu_cores(before, self.cpu_last)

    def figures(self, devices: int, prx_per_device: float | None) -> dict[str, object]:
        """Throughput, time to first result and CPU cores, per device and against PRX's
        figure (None: a run that is no GPU measurement has no ratio to it)."""
        rows = self.marks[-1][1] if self.marks else 0
        # A stage that failed has no end, one never reached no start.
        wall = (self.ended or time.perf_counter()) - self.started if self.started else 0.0
        steady = self.steady
        if steady and steady[0] > 0:
            rate = steady[1] / steady[0]
        else:
            rate = rows / wall if wall > 0 else 0.0
        per_device = rate / max(1, devices)
        cores = self.cores()
        feed = round(sum(v for g, v in cores.items() if g != MODEL), 3)
        return {
            "rows": rows,
            "wall_s": round(wall, 2),
            "time_to_first_result_s": round(self.marks[0][0] - self.started, 2)
            if self.marks else None,
            "steady_s": round(steady[0], 2) if steady else None,
            "steady_rows": steady[1] if steady else None,
            "rows_per_s": round(rate, 3),
            "whole_run_rows_per_s": round(rows / wall, 3) if wall > 0 else 0.0,
            "rows_per_s_per_gpu": round(per_device, 3),
            "prx_rows_per_s_per_gpu": prx_per_device,
            "ratio_to_prx": round(per_device / prx_per_device, 4) if prx_per_device else None,
            "cpu_cores_by_group": cores,
            "feed_cpu_cores": feed,
            "feed_cpu_cores_per_gpu": round(feed / max(1, devices), 3),
            "cut_at_cap": self.cut,
            "processes_by_group": self.cpu_last.names() if self.cpu_last else {},
        }


# Captions embedded for the embedding's own rate (enough for a steady GPU batch stream).
EMBEDDING_SAMPLE = 4096


def embedding_figures(labeler: Any, label_inputs: Path) -> dict[str, Any]:
    """MiniLM's rate alone on the device the labeller (a `LabelerSpec`) embeds on (the GPU
    under vllm, beside the engine; the CPU in `--tiny`), over the label inputs, after a
    warm-up batch."""
    import lance

    from prx_assets.models.embeddings import MiniLMEmbedder

    device = labeler.embedding_device()
    if not label_inputs.exists():
        return {"device": device, "captions_per_s": None}
    captions = lance.dataset(str(label_inputs)).to_table(
        columns=["caption"], limit=EMBEDDING_SAMPLE).column("caption").to_pylist()
    embedder = MiniLMEmbedder(threads=None if device == "cuda" else 1, device=device)
    embedder.embed(captions[:embedder.batch_size])  # kernels compiled, weights resident
    started = time.perf_counter()
    embedder.embed(captions)
    seconds = time.perf_counter() - started
    return {"device": device, "gpu_share": labeler.embedding_gpus(),
            "captions": len(captions),
            "captions_per_s": round(len(captions) / seconds, 1) if seconds else None}
