"""`python -m bench.gpu`: at toy size on the CPU (`--tiny`) through the real stages, its refusal
without a GPU, and the arithmetic of its figures (GPU readings, CPU groups, the timeline)."""

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import lance
import pytest

from bench.gpu import RESULT, main
from bench.gpu_metrics import (
    DRIVER,
    GROUPS,
    MODEL,
    RAY_CONTROL,
    RAY_WORKERS,
    CpuSnapshot,
    GpuReading,
    StageClock,
    StageCut,
    cpu_cores,
    cpu_group,
    gpu_figures,
    parse_gpu_details,
    parse_smi_line,
)

REPO = Path(__file__).resolve().parents[2]
STAGE_FIELDS = {"rows", "wall_s", "time_to_first_result_s", "steady_s", "steady_rows",
                "rows_per_s", "whole_run_rows_per_s", "rows_per_s_per_gpu",
                "prx_rows_per_s_per_gpu", "ratio_to_prx", "cpu_cores_by_group",
                "feed_cpu_cores", "feed_cpu_cores_per_gpu", "cut_at_cap", "gpu",
                "processes_by_group", "lance_rows"}


@pytest.mark.e2e  # the bench in a subprocess
def test_without_a_gpu_it_says_so_and_exits_non_zero(tmp_path):
    # No nvidia-smi on the PATH: what a machine without a GPU driver looks like.
    env = {**os.environ, "PATH": str(Path(sys.executable).parent), "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "-m", "bench.gpu", str(tmp_path / "out")], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "no CUDA GPU here" in run.stderr and "--tiny" in run.stderr
    assert not (tmp_path / "out" / RESULT).exists()


def test_tiny_run_measures_both_stages_through_their_own_tables(ray_session, tmp_path,
                                                                capsys):
    assert main([str(tmp_path), "--tiny", "--images", "8"]) == 0
    result = json.loads((tmp_path / RESULT).read_text())
    assert result["mode"] == "tiny" and result["error"] is None
    caption, label = result["captioning"], result["classification"]
    for stage in (caption, label):
        assert set(stage) >= STAGE_FIELDS
        assert stage["rows"] == stage["lance_rows"] == 8  # written by the stage itself
        assert 0 < stage["time_to_first_result_s"] <= stage["wall_s"]
        # A toy model on a CPU: plumbing, set beside no published GPU figure.
        assert stage["rows_per_s_per_gpu"] > 0
        assert stage["prx_rows_per_s_per_gpu"] is None and stage["ratio_to_prx"] is None
        assert set(stage["cpu_cores_by_group"]) == set(GROUPS)
        assert stage["gpu"] is None  # no GPU: the fields are there, empty
        assert stage["processes_by_group"][DRIVER] and stage["cut_at_cap"] is False
    assert caption["statuses"] == {"ok": 8} and caption["output_tokens"] == 12
    assert caption["vision_tokens_per_image"] > 0 and caption["tokens_per_word"] > 0
    assert sum(label["labels"].values()) == 8
    # The embedder's own rate, on the device the labeller embeds on (the CPU here).
    assert label["embedding"]["device"] == "cpu" and label["embedding"]["captions"] == 8
    assert label["embedding"]["captions_per_s"] > 0
    tables = Path(result["tables"])
    captions = lance.dataset(str(tables / "captions.lance")).to_table().to_pylist()
    assert {r["caption_version"] for r in captions} == {caption["caption_version"]}
    assert {r["backend"] for r in captions} == {"transformers"}
    labels = lance.dataset(str(tables / "labels.lance")).to_table().to_pylist()
    assert {r["classifier_version"] for r in labels} == {label["classifier_version"]}
    assert set(result["setup_s"]) == {"models", "inputs", "ray"}
    assert result["prx"] is None and result["figures_are"].startswith("plumbing only")
    printed = capsys.readouterr().out
    assert "plumbing" in printed and "ratio " not in printed and "PRX" not in printed
    versions = result["versions"]  # what a figure needs to be reproduced
    assert set(versions) >= {"vllm", "torch", "transformers", "cuda", "driver", "driver_cuda",
                             "gpu_models"}
    assert versions["torch"] == importlib.metadata.version("torch")
    assert versions["transformers"] == importlib.metadata.version("transformers")


def test_the_driver_its_cuda_and_each_gpu_model_are_read_from_nvidia_smi():
    banner = "| NVIDIA-SMI 580.95.05   Driver Version: 580.95.05   CUDA Version: 13.0     |\n"
    listed = "NVIDIA H100 80GB HBM3, 580.95.05, 81559\nNVIDIA H100 80GB HBM3, 580.95.05, 81559\n"
    assert parse_gpu_details(listed, banner) == {
        "driver": "580.95.05", "driver_cuda": "13.0",
        "gpu_models": ["NVIDIA H100 80GB HBM3 (81559 MiB)"] * 2}
    assert parse_gpu_details("", "") == {"driver": None, "driver_cuda": None, "gpu_models": []}


def test_nvidia_smi_lines_become_readings():
    assert parse_smi_line("0, 87, 120832, 143771\n", 5.0) == GpuReading(5.0, 0, 87.0, 120832.0,
                                                                        143771.0)
    assert parse_smi_line("0, [N/A], 1, 2", 5.0) is None
    assert parse_smi_line("index, utilization.gpu", 5.0) is None


def test_gpu_figures_average_the_steady_window_and_peak_the_stage():
    readings = [GpuReading(t, index, util, used, 1000.0)
                for t, index, util, used in ((1, 0, 0, 100), (2, 0, 50, 900), (3, 0, 100, 950),
                                             (3, 1, 0, 990), (9, 0, 0, 10))]
    figures = gpu_figures(readings, gpus=1, steady=(2, 3), stage=(1, 4))
    assert figures == {"util_mean_pct": 75.0, "util_samples": 2, "memory_peak_mib": 950.0,
                       "memory_total_mib": 1000.0}
    assert gpu_figures([], 1, (0, 1), (0, 1)) is None


@pytest.mark.parametrize("pid, name, cmdline, group", [
    (10, "python", "python -m bench.gpu out", DRIVER),
    (11, "VLLM::EngineCor", "VLLM::EngineCore_DP0", MODEL),
    (11, "ray::MapWorker", "ray::MapWorker(MapBatches(vLLMEngineStageUDF))", RAY_WORKERS),
    (11, "ray::MapWorker", "ray::MapWorker(MapBatches(EmbeddingStage))", RAY_WORKERS),
    (11, "raylet", "/x/raylet --node_ip_address=127.0.0.1", RAY_CONTROL),
])
def test_the_engine_core_is_the_model_and_the_rest_is_the_feed(pid, name, cmdline, group):
    assert cpu_group(pid, 10, name, cmdline, ("enginecor",)) == group


def test_cpu_cores_are_seconds_over_wall_per_group():
    before = CpuSnapshot(10.0, {1: (DRIVER, 5.0, "python"), 2: (MODEL, 1.0, "engine"),
                                3: (RAY_WORKERS, 2.0, "ray::gone")})
    after = CpuSnapshot(12.0, {1: (DRIVER, 6.0, "python"), 2: (MODEL, 5.0, "engine"),
                               4: (RAY_WORKERS, 3.0, "ray::new")})
    cores = cpu_cores(before, after)
    assert (cores[DRIVER], cores[MODEL], cores[RAY_WORKERS]) == (0.5, 2.0, 1.5)
    assert after.names()[RAY_WORKERS] == ["ray::new"]


def test_the_clock_splits_start_up_from_steady_state_and_cuts_at_its_cap(monkeypatch):
    snapshots = iter([104.0, 106.0, 112.0])  # when each commit's CPU snapshot is taken
    monkeypatch.setattr("bench.gpu_metrics.cpu_snapshot",
                        lambda root, markers, exclude: CpuSnapshot(next(snapshots)))
    monkeypatch.setattr("bench.gpu_metrics.time.perf_counter", lambda: 115.0)
    clock = StageClock("captioning", 1, (), cap_s=5.0)
    clock.started = 100.0
    clock.mark(64)  # the first result: start-up and the first chunk
    clock.mark(128)
    with pytest.raises(StageCut):
        clock.mark(256)  # 8 s after the first result, past the 5 s cap
    figures = clock.figures(devices=2, prx_per_device=20.0)
    assert clock.cut and figures["cut_at_cap"]
    assert (figures["time_to_first_result_s"], figures["wall_s"]) == (4.0, 15.0)
    assert (figures["steady_s"], figures["steady_rows"]) == (8.0, 192)
    assert (figures["rows_per_s"], figures["rows_per_s_per_gpu"]) == (24.0, 12.0)
    assert figures["ratio_to_prx"] == 0.6
    assert clock.figures(devices=2, prx_per_device=None)["ratio_to_prx"] is None
