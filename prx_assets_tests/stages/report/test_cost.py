"""Cost per 1,000 images from a run's measured wall time."""

import pytest

from prx_assets.stages.report.cost import cost_markdown, cost_per_1000


def test_a_gpu_run_is_priced_per_gpu_hour():
    # 600 images in 60 s on 2 GPUs: 100 s per 1,000, 200 GPU-seconds = 0.0556 GPU-hours.
    cost = cost_per_1000(60.0, 600, gpus=2, gpu_hour_usd=3.6, cpu_hour_usd=0.4)
    assert cost is not None
    assert cost.seconds == pytest.approx(100.0)
    assert cost.device_hours == pytest.approx(200 / 3600)
    assert cost.usd == pytest.approx(0.2)
    assert cost_markdown(cost) == ("**100.0 s** per 1,000 images on 2 GPUs = 0.0556 GPU-hours "
                                   "≈ **$0.2000** (at $3.60 per GPU-hour)")


def test_a_gpu_less_run_is_priced_per_cpu_machine_hour():
    cost = cost_per_1000(36.0, 1000, gpus=0, gpu_hour_usd=3.6, cpu_hour_usd=0.5)
    assert cost is not None
    assert (cost.device, cost.devices) == ("CPU machine", 1.0)
    assert cost.usd == pytest.approx(0.005)
    assert "on 1 CPU machine = 0.0100 CPU machine-hours" in cost_markdown(cost)


def test_nothing_processed_has_no_cost():
    assert cost_per_1000(12.0, 0, gpus=1, gpu_hour_usd=3.5, cpu_hour_usd=0.4) is None
    assert cost_per_1000(0.0, 10, gpus=1, gpu_hour_usd=3.5, cpu_hour_usd=0.4) is None
