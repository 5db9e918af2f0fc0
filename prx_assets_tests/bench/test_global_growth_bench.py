"""The global growth bench's scoring: pairs of rows sharing a group, and ids to rows."""

import os

import numpy as np
import pyarrow as pa

from bench.global_growth import (
    STEPS,
    SizeRun,
    StepRun,
    figures,
    load_progress,
    pair_scores,
    parse_sizes,
    row_id,
    rows_of,
    save_progress,
    truth_path,
    write_sources,
)


def test_pair_scores_count_pairs_of_rows_sharing_a_group():
    truth = np.array([0, 0, 0, 1, 1, -1, -1])  # pairs: 3 + 1
    found = np.array([5, 5, -1, 7, 7, 9, 9])  # pairs: (0,1) and (3,4) true, (5,6) false
    recall, precision = pair_scores(found, truth)
    assert (recall, precision) == (2 / 4, 2 / 3)
    assert pair_scores(truth, truth) == (1.0, 1.0)
    assert pair_scores(np.full(7, -1), truth) == (0.0, 0.0)


def test_ids_name_their_rows_and_sizes_parse():
    ids = pa.array([row_id("s2", 12), row_id("s0", 0), row_id("s3", 10**9)])
    assert rows_of(ids).tolist() == [12, 0, 10**9]
    assert parse_sizes("1e5,1e6, 2000") == [2000, 100_000, 1_000_000]


def test_a_size_stopped_after_its_first_step_still_reports_it(tmp_path):
    # What a size measured is saved as it goes; a watchdog stopping the size's driver
    # before the others leaves the first step's figures, recall and precision included.
    stopped = SizeRun(10**7, {"duplicates": StepRun(100.0, 25.0, 349 << 10, 970 << 10,
                                                     recall=1.0, precision=0.99)})
    save_progress(stopped, tmp_path / "progress.json")
    loaded = load_progress(tmp_path / "progress.json")
    assert loaded == stopped and load_progress(tmp_path / "none.json") is None
    base = SizeRun(10**5, {name: StepRun(1.0, 1.0, 100 << 10, 200 << 10, rerun_s=0.01)
                           for name in STEPS})
    names = {f.metric for f in figures([base, loaded])}
    assert {"duplicates recall, 1e7", "duplicates precision, 1e7",
            "duplicates driver MB, 1e7"} <= names
    assert not any(n.startswith(("semdedup", "concepts")) and n.endswith("1e7") for n in names)
    assert "duplicates +0.1 % rerun, 1e7" not in names  # not reached


def test_the_planted_groups_stay_out_of_the_measured_driver(tmp_path):
    # Returned to the driver, 8 bytes a row sat in its peak through every step (80 MB at
    # 10^7); the scorer reads them from beside the rows.
    assert write_sources(tmp_path, 40) is None
    groups = np.load(truth_path(tmp_path))
    assert groups.shape == (40,) and (groups >= 0).any()


def test_the_step_peak_leaves_its_own_sampling_out_and_backs_off(monkeypatch):
    """The sampler's reads of /proc cost CPU in the measured process (0.2 s a sample at
    10^7 rows): left out of the step's CPU, and at most SAMPLER_SHARE of a core."""
    import time

    from bench import proc_memory
    from bench.proc_memory import KINDS, TreeSample

    def burn(seconds: float) -> None:
        start = time.thread_time()
        while time.thread_time() - start < seconds:
            pass

    def costly_sample(root: int) -> TreeSample:
        burn(0.02)
        return TreeSample(by_name={}, by_kind=dict.fromkeys(KINDS, 0),
                          cpu_s=time.process_time())

    monkeypatch.setattr(proc_memory, "sample_tree", costly_sample)
    with proc_memory.StepPeak(interval=0.001) as peak:
        started, main = time.perf_counter(), time.thread_time()
        burn(0.4)
        main = time.thread_time() - main
    elapsed = time.perf_counter() - started
    assert peak.own_cpu_s > 0
    # What is left: the main thread's burn and the closing sample's (in the main thread).
    assert abs(peak.cpu_s - main - 0.02) < 0.015
    assert peak.own_cpu_s <= proc_memory.SAMPLER_SHARE * elapsed + 0.05


def test_the_tree_monitor_reads_memory_within_its_share_and_cpu_every_time(monkeypatch):
    """bench.scale's monitor runs beside the 2-core run it measures: reading smaps_rollup
    every 0.5 s took a fifth of a core from it. Memory is read within MONITOR_SHARE of a
    core; the CPU timeline still gets every interval."""
    import time

    from bench import proc_memory
    from bench.proc_memory import KINDS, TreeSample

    def sample(root: int, memory: bool = True) -> TreeSample:
        if memory:  # smaps_rollup's cost
            start = time.thread_time()
            while time.thread_time() - start < 0.02:
                pass
        return TreeSample(by_name={}, by_kind=dict.fromkeys(KINDS, 0), cpu_s=0.0)

    monkeypatch.setattr(proc_memory, "sample_tree", sample)
    started = time.perf_counter()
    with proc_memory.TreeMemoryMonitor(os.getpid(), interval=0.001) as monitor:
        while len(monitor.timeline) < 200:
            time.sleep(0.001)
    elapsed = time.perf_counter() - started
    memory_samples = monitor.peaks.samples
    assert memory_samples >= 1
    assert memory_samples * 0.02 <= proc_memory.MONITOR_SHARE * elapsed + 0.02 + 0.05
    assert len(monitor.timeline) >= 200 > memory_samples
