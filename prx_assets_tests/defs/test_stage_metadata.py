"""What the captions asset records about its run: durations beside their words."""

from prx_assets.defs.captions import run_metadata
from prx_assets.defs.report import cost_metadata, duration_metadata
from prx_assets.defs.resources import CaptionerResource, ClassifierResource
from prx_assets.engine.chunked import ChunkedRun
from prx_assets.engine.stage import Coverage
from prx_assets.stages.captions.captioners import CaptionerSpec
from prx_assets.stages.captions.runs import CaptionRunReport


def test_a_duration_is_a_number_and_words():
    meta = duration_metadata("stage_seconds", 75.04)
    assert meta["stage_seconds"] == 75.04
    assert meta["stage_seconds_in_words"].value == "1 min 15 s"


def test_the_captions_run_reports_its_wall_time_in_words():
    report = CaptionRunReport(version="v1",
                              commits=ChunkedRun(rows=300, committed=300, seconds=150.0))
    cover = Coverage(inputs=7200, counts={"ok": 300})
    meta = run_metadata(report, CaptionerSpec(), cover)
    assert meta["stage_seconds"] == 150.0
    assert meta["stage_seconds_in_words"].value == "2 min 30 s"
    # 7,200 kept images at 2 images/s: an hour of this stage.
    assert meta["projected_time_in_words"].value == "1 h 0 min"


def test_cost_per_1000_images_is_recorded_only_when_rows_were_processed():
    meta = cost_metadata(30.0, 1000, gpus=1, gpu_hour_usd=3.6, cpu_hour_usd=0.4)
    assert meta["cost_per_1000_images"].value.startswith("**30.0 s** per 1,000 images on 1 GPU")
    assert meta["cost_per_1000_images_usd"] == 0.03
    assert cost_metadata(30.0, 0, gpus=1, gpu_hour_usd=3.6, cpu_hour_usd=0.4) == {}


def test_the_prices_are_resource_config_and_vllm_labelling_holds_gpus():
    assert CaptionerResource(gpu_hour_usd=2.0).gpu_hour_usd == 2.0
    assert ClassifierResource().gpus() == 0.0  # embedded: on the CPU
    assert ClassifierResource(backend="vllm", concurrency=2).gpus() == 2.0
