"""What the captions asset records about its run: durations beside their words."""

from prx_assets.defs.captions import run_metadata
from prx_assets.defs.report import duration_metadata
from prx_assets.engine.chunked import ChunkedRun
from prx_assets.stages.captions.captioners import CaptionerSpec
from prx_assets.stages.captions.runs import CaptionRunReport, Coverage


def test_a_duration_is_a_number_and_words():
    meta = duration_metadata("stage_seconds", 75.04)
    assert meta["stage_seconds"] == 75.04
    assert meta["stage_seconds_in_words"].value == "1 min 15 s"


def test_the_captions_run_reports_its_wall_time_in_words():
    report = CaptionRunReport(version="v1",
                              commits=ChunkedRun(rows=300, committed=300, seconds=150.0))
    cover = Coverage(kept=7200, done=300, ok=300, failed=0, in_target=300)
    meta = run_metadata(report, CaptionerSpec(), cover)
    assert meta["stage_seconds"] == 150.0
    assert meta["stage_seconds_in_words"].value == "2 min 30 s"
    # 7,200 kept images at 2 images/s: an hour of this stage.
    assert meta["projected_time_in_words"].value == "1 h 0 min"
