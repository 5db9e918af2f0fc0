"""Peak memory of a process tree, read from /proc (psutil is not a dependency).

Also the tree's CPU seconds, which on a shared machine compare more fairly than wall time.

RSS counts a shared page in every process that maps it (Ray's plasma store is mapped by the
raylet and by every worker that read an object), so the RSS sum overstates the tree's
footprint; PSS splits each shared page between its users and sums to the real total; USS
is what each process holds alone.

Each sample also splits the tree's PSS by process kind (`process_kind`): the driver, busy and
idle Ray workers, Ray's control plane, and shared memory (Ray's object store is /dev/shm:
its pages are the processes' `Pss_Shmem`, moved out of each process into its own kind, so the
kinds sum to the tree's PSS).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class TreeSample:
    rss_kb: int = 0
    pss_kb: int = 0
    uss_kb: int = 0
    processes: int = 0
    cpu_s: float = 0.0  # CPU seconds of the live processes and the children they reaped
    by_name: dict[str, int] = field(default_factory=dict)  # PSS kB per process name
    by_kind: dict[str, int] = field(default_factory=dict)  # PSS kB per process kind
    cpu_by_pid: dict[int, tuple[str, float]] = field(default_factory=dict)  # (kind, CPU s)
    task_of_pid: dict[int, str] = field(default_factory=dict)  # a busy worker's task title
    title_of_pid: dict[int, str] = field(default_factory=dict)  # every process (`process_title`)


@dataclass
class CoreUse:
    """The tree's CPU over one sampling interval: what the cores did from `start` to `end`
    (wall clock, comparable with Dagster's event timestamps)."""

    start: float
    end: float
    by_kind: dict[str, float]  # CPU seconds per process kind in the interval
    machine_busy_s: float  # CPU seconds the whole machine spent busy (other helpers too)
    # CPU seconds per busy worker's task title (`ray::MapBatches(bucket_batch)`): which Ray
    # work held the cores in the interval.
    by_task: dict[str, float] = field(default_factory=dict)
    # CPU seconds per process title (`process_title`: the driver, raylet, a Ray Data actor,
    # an idle worker): who else held them.
    by_process: dict[str, float] = field(default_factory=dict)
    # The whole machine's waits on the disk in the interval (`machine_counters`): core seconds
    # idle with a read or write outstanding, and MB read from disk (page-cache misses).
    iowait_s: float = 0.0
    read_mb: float = 0.0

    @property
    def cpu_s(self) -> float:
        return sum(self.by_kind.values())

    @property
    def tree_cores(self) -> float:
        return self.cpu_s / (self.end - self.start)


def timeline_cpu_s(timeline: list[CoreUse]) -> float:
    """The tree's CPU seconds over its sampled intervals: each process counted while it
    lived (a worker that exited before the last sample keeps what it used)."""
    return sum(use.cpu_s for use in timeline)


@dataclass
class Peaks:
    rss_kb: int = 0
    pss_kb: int = 0
    uss_kb: int = 0
    samples: int = 0
    max_processes: int = 0
    cpu_s: float = 0.0  # the tree's CPU seconds, as of the last sample
    at_pss_peak: dict[str, int] = field(default_factory=dict)  # PSS kB per process name
    kinds_at_pss_peak: dict[str, int] = field(default_factory=dict)  # PSS kB per kind

    def update(self, sample: TreeSample) -> None:
        self.samples += 1
        self.rss_kb = max(self.rss_kb, sample.rss_kb)
        self.uss_kb = max(self.uss_kb, sample.uss_kb)
        self.max_processes = max(self.max_processes, sample.processes)
        self.cpu_s = max(self.cpu_s, sample.cpu_s)
        if sample.pss_kb > self.pss_kb:
            self.pss_kb, self.at_pss_peak = sample.pss_kb, sample.by_name
            self.kinds_at_pss_peak = sample.by_kind


def children_of() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = defaultdict(list)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            # The name may hold spaces and parentheses: the ppid follows the last ')'.
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])
            tree[ppid].append(int(entry.name))
    return tree


def descendants(root: int) -> list[int]:
    tree, found, stack = children_of(), [], [root]
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack.extend(tree.get(pid, []))
    return found


def available_gib() -> float:
    """MemAvailable of the machine, GiB."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return float("inf")


def stop_tree(process: multiprocessing.process.BaseProcess, grace_s: float = 60.0) -> None:
    """SIGINT to the size's driver (Ray shuts its processes down on the way out), then
    SIGKILL to what is left of its process tree."""
    pids = descendants(process.pid or 0)
    os.kill(process.pid or 0, signal.SIGINT)
    process.join(grace_s)
    pids += descendants(process.pid or 0) if process.is_alive() else []  # started since
    for pid in reversed(pids):  # the Ray processes it started outlive a killed driver
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    process.join()


def cpu_seconds(pid: int) -> float:
    """utime + stime + cutime + cstime: the process and the children it has reaped."""
    try:
        stat = (Path("/proc") / str(pid) / "stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2:].split()
    return sum(int(v) for v in fields[11:15]) / CLOCK_TICKS


DRIVER, BUSY, IDLE, CONTROL, SHARED, OTHER = (
    "driver", "Ray workers busy", "Ray workers idle", "Ray control plane",
    "shared memory (object store)", "other")
KINDS = (DRIVER, BUSY, IDLE, CONTROL, SHARED, OTHER)
# Ray's own daemons, by name (raylet, gcs_server) or, for its Python ones, by command line;
# with them Ray's and Ray Data's bookkeeping actors (agents, stats, autoscaling, locations).
CONTROL_MARKERS = ("raylet", "gcs_server", "dashboard", "agent", "log_monitor", "monitor.py",
                   "ray_client_server", "runtime_env", "statsactor", "autoscalingcoordinator",
                   "actorlocationtracker")


def process_kind(pid: int, root: int, name: str, cmdline: str) -> str:
    """The kind of one process of the tree under `root` (the driver)."""
    if pid == root:
        return DRIVER
    if name == "ray::IDLE":
        return IDLE
    title = cmdline.split(" ", 1)[0].lower() if name.startswith("ray::") else cmdline.lower()
    # Before the workers: the raylet's own command line names default_worker.py.
    if any(marker in name.lower() or marker in title for marker in CONTROL_MARKERS):
        return CONTROL
    if name.startswith("ray::"):  # a worker titles itself ray::<task or actor> while busy
        return BUSY
    if "default_worker.py" in cmdline:  # a worker starting, not yet titled
        return IDLE
    return OTHER


# A task title past this many characters is cut (an actor's title names its whole chain).
TASK_TITLE_CHARS = 80


def task_title(cmdline: str) -> str:
    """A busy worker's title (`ray::<task or actor>`, Ray's process title), cut short."""
    return cmdline.split(" ", 1)[0][:TASK_TITLE_CHARS]


def process_title(kind: str, name: str, cmdline: str) -> str:
    """A process as a person would name it: `driver`, a Ray title (`ray::IDLE`,
    `ray::_StatsActor`, a task), a daemon's name (`raylet`), or a Python script's file."""
    if kind == DRIVER:
        return DRIVER
    if cmdline.startswith("ray::"):
        return task_title(cmdline)
    scripts = [Path(arg).name for arg in cmdline.split(" ")[1:4] if arg.endswith(".py")]
    return f"{name} {scripts[0]}" if scripts else name


def command_line(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(
            errors="replace")
    except OSError:
        return ""


def process_name(pid: int) -> tuple[str, int, int, int, int] | None:
    """`process_memory`'s shape without the memory (zeros): the name alone."""
    try:
        return (Path("/proc") / str(pid) / "comm").read_text().strip(), 0, 0, 0, 0
    except OSError:
        return None


def process_memory(pid: int) -> tuple[str, int, int, int, int] | None:
    """(name, rss, pss, uss, pss of shared memory) in kB, or None when the process has gone."""
    try:
        name = (Path("/proc") / str(pid) / "comm").read_text().strip()
        fields = {}
        for line in (Path("/proc") / str(pid) / "smaps_rollup").read_text().splitlines()[1:]:
            key, value = line.split(":", 1)
            fields[key] = int(value.split()[0])
    except (OSError, ValueError, IndexError):
        return None
    uss = fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0)
    return name, fields.get("Rss", 0), fields.get("Pss", 0), uss, fields.get("Pss_Shmem", 0)


def sample_tree(root: int, memory: bool = True) -> TreeSample:
    """The tree's memory, CPU and kinds now; `memory` False reads no `smaps_rollup` (the
    costly part: the kernel walks every mapping), only names, command lines and CPU."""
    sample = TreeSample(by_name=defaultdict(int), by_kind=dict.fromkeys(KINDS, 0))
    for pid in descendants(root):
        usage = process_memory(pid) if memory else process_name(pid)
        if usage is None:
            continue
        name, rss, pss, uss, shmem = usage
        cmdline = command_line(pid)
        kind = process_kind(pid, root, name, cmdline)
        sample.by_kind[kind] += pss - shmem
        sample.by_kind[SHARED] += shmem
        sample.rss_kb += rss
        sample.pss_kb += pss
        sample.uss_kb += uss
        sample.processes += 1
        cpu = cpu_seconds(pid)
        sample.cpu_s += cpu
        sample.cpu_by_pid[pid] = (kind, cpu)
        if kind == BUSY:
            sample.task_of_pid[pid] = task_title(cmdline)
        sample.title_of_pid[pid] = process_title(kind, name, cmdline)
        sample.by_name[name] += pss
    sample.by_name = dict(sample.by_name)
    return sample


class BackgroundSampler:
    """A context manager running `_run` on a daemon thread until the block ends; `_run`
    samples every `interval` seconds until `_stop` is set."""

    def __init__(self, interval: float):
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class MachineCounters:
    """The whole machine's counters since boot, read once a sample: CPU seconds its cores
    spent busy and idle in iowait (/proc/stat), and MB paged in from disk (/proc/vmstat
    `pgpgin`: file reads that missed the page cache). `since` gives an interval's."""

    busy_s: float
    iowait_s: float = 0.0
    read_mb: float = 0.0

    def since(self, before: MachineCounters) -> MachineCounters:
        return MachineCounters(self.busy_s - before.busy_s, self.iowait_s - before.iowait_s,
                               self.read_mb - before.read_mb)


def machine_counters() -> MachineCounters:
    ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle, iowait = ticks[3], ticks[4]
    paged_in_kb = next((int(line.split()[1]) for line in Path("/proc/vmstat").read_text()
                        .splitlines() if line.startswith("pgpgin ")), 0)
    return MachineCounters((sum(ticks[:8]) - idle - iowait) / CLOCK_TICKS,
                           iowait / CLOCK_TICKS, paged_in_kb / 1024)


def core_use(previous: TreeSample, current: TreeSample, start: float, end: float,
             machine: MachineCounters) -> CoreUse:
    """What each kind of process used between two samples: each live process's CPU delta
    under its current kind (a worker turns busy or idle between samples); a process born
    in the interval counts whole, the reaped ones through their parent's children time;
    `machine`: the whole machine's counters over the interval."""
    by_kind: dict[str, float] = dict.fromkeys(KINDS, 0.0)
    by_task: dict[str, float] = defaultdict(float)
    by_process: dict[str, float] = defaultdict(float)
    for pid, (kind, cpu) in current.cpu_by_pid.items():
        before = previous.cpu_by_pid.get(pid, (kind, 0.0))[1]
        used = max(0.0, cpu - before)
        by_kind[kind] += used
        if pid in current.task_of_pid and used:
            by_task[current.task_of_pid[pid]] += used
        if used:
            by_process[current.title_of_pid.get(pid, kind)] += used
    return CoreUse(start, end, by_kind, machine.busy_s, dict(by_task), dict(by_process),
                   machine.iowait_s, machine.read_mb)


# Of one core, at most, for the memory reads of bench.scale's monitor (`TreeMemoryMonitor`).
MONITOR_SHARE = 0.05


class TreeMemoryMonitor(BackgroundSampler):
    """Samples the tree under `root` every `interval` seconds on a thread until stopped;
    besides the peaks, `timeline` holds what the cores did between consecutive samples."""

    def __init__(self, root: int, interval: float = 0.5, dump: Path | None = None):
        super().__init__(interval)
        self.root, self.peaks, self.dump = root, Peaks(), dump
        self.timeline: list[CoreUse] = []

    def _run(self) -> None:
        previous, previous_at, previous_machine = None, 0.0, machine_counters()
        began, memory_cpu_s = time.perf_counter(), 0.0
        while not self._stop.is_set():
            started, cpu_started = time.perf_counter(), time.thread_time()
            # Memory (smaps_rollup: 34 ms of CPU a sample at 12 processes, ~90 at 20) only
            # while this thread's share of a core stays under MONITOR_SHARE: read every
            # 0.5 s, it took up to a fifth of a core from the 2-core run it measured. CPU
            # and kinds (3 ms) every time.
            memory = memory_cpu_s <= MONITOR_SHARE * (started - began) or previous is None
            sample = sample_tree(self.root, memory)
            at, machine = time.time(), machine_counters()
            if memory:
                memory_cpu_s += time.thread_time() - cpu_started
                self.peaks.update(sample)
            self.peaks.cpu_s = max(self.peaks.cpu_s, sample.cpu_s)
            if previous is not None:
                self.timeline.append(core_use(previous, sample, previous_at, at,
                                              machine.since(previous_machine)))
            previous, previous_at, previous_machine = sample, at, machine
            if memory and self.dump is not None:  # the peaks so far survive a cut run
                self.dump.write_text(json.dumps(asdict(self.peaks)))
            self._stop.wait(max(0.0, self.interval - (time.perf_counter() - started)))


# Of one core, at most, for a sampler in the measured process (`StepPeak`).
SAMPLER_SHARE = 0.1


class StepPeak(BackgroundSampler):
    """Peak PSS of this process (the driver) and of its Ray workers, from /proc, and where
    the driver's code was at its peak (the main thread's innermost project frames)."""

    def __init__(self, interval: float = 0.2):
        super().__init__(interval)
        self.driver_kb = self.workers_kb = 0
        self.peak_at = ""
        self._main = threading.main_thread().ident
        self.cpu_start = self.cpu_s = 0.0
        self.own_cpu_s = 0.0  # this sampler's thread: in the driver's CPU, not the step's

    def __enter__(self):
        self.cpu_start = sample_tree(os.getpid()).cpu_s
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self.cpu_s = sample_tree(os.getpid()).cpu_s - self.cpu_start - self.own_cpu_s

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.thread_time()
            sample = sample_tree(os.getpid())
            driver = sample.by_kind.get(DRIVER, 0)
            if driver > self.driver_kb:
                self.driver_kb, self.peak_at = driver, self._main_frames()
            workers = sample.by_kind.get(BUSY, 0) + sample.by_kind.get(IDLE, 0)
            self.workers_kb = max(self.workers_kb, workers)
            spent = time.thread_time() - started
            self.own_cpu_s += spent
            # The kernel walks every mapping for smaps_rollup: at 10^7 rows (20 processes,
            # GBs each) a sample took 0.2 CPU s, so every 0.2 s was a core taken from the
            # step (and counted in its CPU). Past `SAMPLER_SHARE` of a core it waits longer.
            self._stop.wait(max(self.interval, spent / SAMPLER_SHARE))

    def _main_frames(self, depth: int = 3) -> str:
        frame = sys._current_frames().get(self._main or 0)
        frames = [f"{Path(f.filename).stem}:{f.lineno}" for f in traceback.extract_stack(frame)
                  if "/prx_assets/" in f.filename] if frame is not None else []
        return " < ".join(reversed(frames[-depth:]))
