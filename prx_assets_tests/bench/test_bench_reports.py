"""The benches' own bookkeeping: process kinds in the memory sampler, run sizes of the scale
bench, the caption bench's phases."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bench.captions import phases
from bench.core_profile import core_profile
from bench.core_timeline import bins
from bench.proc_memory import (
    BUSY,
    CONTROL,
    DRIVER,
    IDLE,
    KINDS,
    OTHER,
    SHARED,
    CoreUse,
    MachineCounters,
    TreeSample,
    core_use,
    descendants,
    process_kind,
    process_memory,
    sample_tree,
    task_title,
)
from bench.scale import KernelRun, run_sizes

# A child that maps 16 MiB of POSIX shared memory, touches it, and waits for stdin to close.
SHM_CHILD = """
import sys
from multiprocessing import shared_memory
block = shared_memory.SharedMemory(create=True, size=16 << 20)
page = b"x" * (1 << 20)
for start in range(0, len(block.buf), len(page)):  # no 16 MiB temporary of its own
    block.buf[start:start + len(page)] = page
print("ready", flush=True)
sys.stdin.read()
block.close(); block.unlink()
"""


def test_kinds_split_the_tree_and_move_shared_memory_apart():
    child = subprocess.Popen([sys.executable, "-c", SHM_CHILD], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"  # an explicit signal, no timer
        sample = sample_tree(os.getpid())
        # The child and what it started (multiprocessing's resource tracker), as a whole.
        helpers = [process_memory(pid) for pid in descendants(os.getpid())[1:]]
    finally:
        child.stdin.close()
        child.wait()
    helpers_pss = sum(memory[2] for memory in helpers if memory)
    assert set(sample.by_kind) == set(KINDS), sample
    assert sum(sample.by_kind.values()) == sample.pss_kb
    assert sample.by_kind[DRIVER] > 0
    assert sample.by_kind[SHARED] >= 15 * 1024, sample  # the child's 16 MiB block, in kB
    # ... and only there: the helpers' own kind holds their PSS less the block (2 MiB slack
    # for memory that moved between the two readings).
    assert sample.by_kind[OTHER] <= helpers_pss - 15 * 1024 + 2048, (sample, helpers_pss)


@pytest.mark.parametrize("name, cmdline, kind", [
    ("python", "python -m bench.scale --child", DRIVER),
    ("ray::IDLE", "ray::IDLE", IDLE),
    ("ray::MapBatches", "ray::MapBatches(bucket_batch)", BUSY),
    ("ray::ReadLance-", "ray::ReadLance->SplitBlocks(200)", BUSY),
    ("ray::_StatsActo", "ray::_StatsActor", CONTROL),
    ("ray::_Autoscali", "ray::_AutoscalingCoordinatorActor", CONTROL),
    ("ray::DashboardA", "ray::DashboardAgent", CONTROL),
    ("ray::RuntimeEnv", "ray::RuntimeEnvAgent", CONTROL),
    ("raylet", "/.../raylet --worker_command=/.../default_worker.py --x=1", CONTROL),
    ("python", "python .../ray/_private/workers/default_worker.py --node-ip-address=x", IDLE),
    ("raylet", "/.../raylet --node_ip_address=127.0.0.1", CONTROL),
    ("gcs_server", "/.../gcs_server --gcs_server_port=1", CONTROL),
    ("python", "python -u .../ray/dashboard/agent.py --node-ip-address=x", CONTROL),
    ("python", "python -u .../ray/_private/log_monitor.py --session-dir=x", CONTROL),
    ("python", "python -c from multiprocessing.spawn import spawn_main", OTHER),
])
def test_process_kind(name, cmdline, kind):
    pid = 10 if kind == DRIVER else 11
    assert process_kind(pid, 10, name, cmdline) == kind


def test_run_sizes(monkeypatch):
    monkeypatch.setenv("PRX_SCALE_IMAGES", "10000")
    assert run_sizes() == {"small": 500, "mid": 2000, "full": 10000}
    monkeypatch.setenv("PRX_SCALE_RUNS", "mid,full")
    monkeypatch.setenv("PRX_SCALE_MID", "1000")
    assert run_sizes() == {"mid": 1000, "full": 10000}
    monkeypatch.setenv("PRX_SCALE_RUNS", "mid,huge")
    with pytest.raises(SystemExit, match="huge"):
        run_sizes()
    monkeypatch.setenv("PRX_SCALE_RUNS", "small,mid")
    monkeypatch.setenv("PRX_SCALE_SMALL", "5000")
    with pytest.raises(SystemExit, match="grow"):
        run_sizes()


def test_phases_split_start_up_from_steady_state():
    timing = phases(5.0, 100.0, [(103.0, 64, 2.0), (107.0, 128, 6.0), (111.0, 192, 10.0)],
                    112.5)
    assert (timing.first_chunk_s, timing.steady_s, timing.steady_images) == (3.0, 8.0, 128)
    assert timing.finish_s == 1.5 and timing.total_s == 17.5
    assert timing.steady_ms_per_image == pytest.approx(62.5)
    assert timing.steady_cpu_ms_per_image == pytest.approx(62.5)
    assert timing.marks[0] == (3.0, 64, 2.0)
    with pytest.raises(ValueError, match="two chunks"):
        phases(5.0, 100.0, [(103.0, 64, 1.0)], 104.0)


def test_kernel_runs_add_up_as_one_pool():
    first = KernelRun(10, 20.0, 2, {"image": 4.0}, 9, 3.0, 12.0, 100, startup_s=8.0,
                      load_cpu_s=5.0)
    second = KernelRun(30, 25.0, 2, {"image": 12.0, "mds": 1.0}, 28, 3.5, 30.0, 300,
                       startup_s=9.0, load_cpu_s=6.0)
    both = first.plus(second)
    assert (both.images, both.kept, both.mds_bytes) == (40, 37, 400)
    assert both.per_kernel == {"image": 16.0, "mds": 1.0}
    # One pool start and one set of model loads, the first segment's.
    assert both.seconds == 36.0 and both.cpu_seconds == 36.0
    assert (both.startup_s, both.load_cpu_s, both.model_load_s) == (8.0, 5.0, 3.0)


def _core_use(start: float, end: float, driver: float, workers: float, machine: float
              ) -> CoreUse:
    return CoreUse(start, end, {**dict.fromkeys(KINDS, 0.0), DRIVER: driver, BUSY: workers},
                   machine)


def test_the_core_profile_splits_each_sample_over_the_steps_it_overlaps():
    """Per step: the tree's cores, the share with both busy, the driver's cores and the
    rest of the machine's, from the samples that overlap it (in proportion)."""
    timeline = [_core_use(0, 1, 0.2, 1.7, 2.0), _core_use(1, 2, 0.5, 0.0, 1.5)]
    profile = core_profile(timeline, {"a": [[0, 1]], "b": [[1, 1.5]]})
    assert profile["a"]["tree_cores"] == pytest.approx(1.9)
    assert profile["a"]["both_busy"] == 1.0
    assert (profile["b"]["seconds"], profile["b"]["both_busy"]) == (0.5, 0.0)
    assert profile["b"]["driver_cores"] == pytest.approx(0.5)
    assert profile["b"]["others_cores"] == pytest.approx(1.0)  # 1.5 machine - 0.5 tree
    assert profile["(outside steps)"]["seconds"] == pytest.approx(0.5)
    assert profile["(whole run)"]["tree_cpu_s"] == pytest.approx(2.4)


def test_core_use_names_the_busy_tasks_cpu():
    """A busy worker's CPU in the interval goes to its task title as well as its kind; the
    driver's to its kind only."""
    before = TreeSample(cpu_by_pid={1: (DRIVER, 1.0), 2: (BUSY, 3.0)},
                        task_of_pid={2: "ray::MapBatches(f)"})
    after = TreeSample(cpu_by_pid={1: (DRIVER, 1.5), 2: (BUSY, 3.75), 3: (BUSY, 0.25)},
                       task_of_pid={2: "ray::MapBatches(f)", 3: "ray::ReadLance"})
    use = core_use(before, after, 0.0, 1.0, MachineCounters(2.0))
    assert use.by_kind[DRIVER] == 0.5 and use.by_kind[BUSY] == 1.0
    assert use.by_task == {"ray::MapBatches(f)": 0.75, "ray::ReadLance": 0.25}
    assert task_title("ray::MapWorker(MapBatches(EmbeddedLabelStage)) extra") == \
        "ray::MapWorker(MapBatches(EmbeddedLabelStage))"


def test_the_core_timeline_sums_samples_into_bins():
    timeline = [{"start": 10.0 + i, "end": 11.0 + i, "by_kind": {DRIVER: 0.5, BUSY: 1.0},
                 "by_task": {"ray::t": 1.0}, "iowait_s": 0.25 * i} for i in range(3)]
    rows = bins(timeline, 2.0)
    assert [(r["wall"], r["cpu"], r["driver"]) for r in rows] == [(2.0, 3.0, 1.0),
                                                                  (1.0, 1.5, 0.5)]
    assert rows[0]["tasks"] == {"ray::t": 2.0}
    assert [r["iowait"] for r in rows] == [0.25, 0.5]


def test_the_core_profile_counts_the_disk_waits_in_each_steps_window():
    """The machine's iowait and disk reads are split over the steps like its CPU: a step
    whose processes wait on page-cache misses (a model's imports) shows them."""
    quiet, cold = _core_use(0, 1, 0.1, 0.2, 0.3), _core_use(1, 2, 0.1, 0.2, 0.3)
    cold.iowait_s, cold.read_mb = 1.5, 240.0
    profile = core_profile([quiet, cold], {"a": [[0, 1]], "b": [[1, 2]]})
    assert (profile["a"]["iowait_s"], profile["a"]["read_mb"]) == (0.0, 0.0)
    assert (profile["b"]["iowait_s"], profile["b"]["read_mb"]) == (1.5, 240.0)
    assert profile["(whole run)"]["read_mb"] == 240.0


def test_machine_counters_read_busy_iowait_and_the_pages_read_from_disk():
    """From /proc: every counter only grows, and `since` is the interval's share."""
    from bench.proc_memory import machine_counters

    before, after = machine_counters(), machine_counters()
    assert after.busy_s >= before.busy_s > 0
    assert after.iowait_s >= before.iowait_s >= 0 and after.read_mb >= before.read_mb >= 0
    assert MachineCounters(9.0, 3.0, 500.0).since(MachineCounters(4.0, 1.0, 120.0)) == \
        MachineCounters(5.0, 2.0, 380.0)


def test_the_scale_cpu_figure_counts_the_processes_that_exited():
    """The tree's CPU is summed over the timeline's intervals: a worker that exited before
    the last sample keeps what it used."""
    from bench.proc_memory import CoreUse, timeline_cpu_s

    timeline = [CoreUse(0.0, 1.0, {"driver": 0.5, "busy": 1.2}, 2.0),
                CoreUse(1.0, 2.0, {"driver": 0.25, "busy": 0.0}, 1.0)]
    assert timeline_cpu_s(timeline) == 1.95
    assert timeline_cpu_s([]) == 0


def test_stage_steps_together_count_side_by_side_steps_once():
    """The issue's "stage steps together": the wall any stage step ran (caption_labels and
    attributes side by side count once) against every stage's kernel seconds."""
    from bench.proc_memory import Peaks
    from bench.scale import PipelineRun, stages_together, union_seconds

    assert union_seconds([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0), (5.5, 5.7)]) == 4.0
    assert union_seconds([]) == 0.0
    windows = {"raw_images": [[0.0, 1.0]], "caption_labels": [[2.0, 6.0]],
               "attributes": [[2.5, 6.5]], "duplicates": [[7.0, 9.0]]}  # a check: not a stage
    run = PipelineRun(100, 10.0, Peaks(), {"step_windows": windows, "steps": {}})
    kernels = KernelRun(100, 5.0, 2, {"ingest": 1.0, "labels": 3.0, "attributes": 3.0}, 100,
                        0.0, 0.0, 0)
    assert stages_together(run, kernels) == (5.5, 3.5)


def test_every_process_cpu_goes_to_its_title():
    """Beside the busy tasks, the timeline names who else held the cores: the driver, Ray's
    daemons and actors, idle workers, by title."""
    from bench.core_timeline import process_totals
    from bench.proc_memory import process_title

    assert process_title(DRIVER, "python", "python -m bench.scale --child x") == DRIVER
    assert process_title(IDLE, "python", "ray::IDLE ") == "ray::IDLE"
    assert process_title(CONTROL, "raylet", "/x/raylet --flag") == "raylet"
    assert process_title(CONTROL, "python", "/v/python -u /v/ray/dashboard/agent.py --a") == \
        "python agent.py"
    before = TreeSample(cpu_by_pid={1: (DRIVER, 1.0), 2: (CONTROL, 2.0)},
                        title_of_pid={1: DRIVER, 2: "raylet"})
    after = TreeSample(cpu_by_pid={1: (DRIVER, 1.5), 2: (CONTROL, 2.25), 3: (BUSY, 0.5)},
                       title_of_pid={1: DRIVER, 2: "raylet", 3: "ray::ReadLance"},
                       task_of_pid={3: "ray::ReadLance"})
    use = core_use(before, after, 0.0, 1.0, MachineCounters(2.0))
    assert use.by_process == {DRIVER: 0.5, "raylet": 0.25, "ray::ReadLance": 0.5}
    assert process_totals([{"by_process": use.by_process}, {"by_process": {"raylet": 1.0}},
                           {}]) == {DRIVER: 0.5, "raylet": 1.25, "ray::ReadLance": 0.5}
