"""The funnel as asset metadata, and the run-level tag of the checks that warned."""

import dagster as dg

from prx_assets.defs.report import (
    WARNINGS_TAG,
    check_warnings,
    check_warnings_tag,
    funnel_metadata,
    tag_run_with_warnings,
    warnings_tags,
)
from prx_assets.stages.report.funnel import Funnel


def test_the_funnel_is_a_table_and_a_picture():
    funnel = Funnel("demo_folder", raw=124, decodable=120, kept=107, captioned=107,
                    labelled=107, duplicates=6, skipped=8, in_shards=107)
    meta = funnel_metadata(funnel)
    records = [r.data for r in meta["funnel"].value.records]
    assert records[0] == {"stage": "raw", "images": 124, "share_of_raw": "100.0 %"}
    assert records[2] == {"stage": "kept by the filter", "images": 107,
                          "share_of_raw": "86.3 %"}
    assert records[-1] == {"stage": "streamed by loader", "images": 99,
                           "share_of_raw": "79.8 %"}
    chart = meta["funnel_chart"].value  # bars the UI draws inline: under 1,000 characters
    assert chart.startswith("**demo_folder: where the images go**") and len(chart) < 1000
    lines = chart.replace("\u00a0", " ").splitlines()
    assert f"| raw | 124 | {'█' * 12} |" in lines
    assert any(line.startswith("| streamed by loader | 99 | ") for line in lines)
    assert meta["streamed_share_of_raw"].value == "79.8 %"
    assert "opt_in_lists" not in meta
    opted = funnel_metadata(Funnel("s", raw=10, decodable=10, kept=10, captioned=10,
                                   labelled=10, duplicates=0, skipped=0, in_shards=10,
                                   opt_in={"balance": 4}))
    assert opted["opt_in_lists"].value == "balance 4 (skipped only when named)"
    streamed = [r.data for r in opted["funnel"].value.records][-1]
    assert streamed["images"] == 10  # an opt-in list skips nothing by default


@dg.asset
def counted() -> int:
    return 1


@dg.asset_check(asset=counted)
def too_few() -> dg.AssetCheckResult:
    return dg.AssetCheckResult(passed=False, severity=dg.AssetCheckSeverity.WARN)


@dg.asset_check(asset=counted)
def fine() -> dg.AssetCheckResult:
    return dg.AssetCheckResult(passed=True)


def test_a_green_run_with_a_warning_is_tagged_with_it():
    instance = dg.DagsterInstance.ephemeral()
    job = dg.Definitions(assets=[counted], asset_checks=[too_few, fine]
                         ).resolve_implicit_global_asset_job_def()
    result = job.execute_in_process(instance=instance)
    assert result.success  # green, yet one check warned
    assert check_warnings(instance, result.run_id) == ["counted:too_few"]
    assert tag_run_with_warnings(instance, result.run_id) == {WARNINGS_TAG: "1: counted:too_few"}
    assert instance.get_run_by_id(result.run_id).tags[WARNINGS_TAG] == "1: counted:too_few"
    # The sensor does the same for every successful run of the code location.
    second = job.execute_in_process(instance=instance)
    assert WARNINGS_TAG not in instance.get_run_by_id(second.run_id).tags
    success = instance.get_records_for_run(
        second.run_id, of_type=dg.DagsterEventType.RUN_SUCCESS).records[0]
    check_warnings_tag(dg.build_run_status_sensor_context(
        sensor_name="check_warnings_tag", dagster_instance=instance,
        dagster_run=instance.get_run_by_id(second.run_id),
        dagster_event=success.event_log_entry.dagster_event))
    assert instance.get_run_by_id(second.run_id).tags[WARNINGS_TAG] == "1: counted:too_few"


def test_the_tag_says_none_or_names_the_checks_within_its_length():
    assert warnings_tags([]) == {WARNINGS_TAG: "none"}
    many = warnings_tags([f"asset_{i}:check_{i}" for i in range(30)])[WARNINGS_TAG]
    assert many.startswith("30: asset_0:check_0, ") and len(many) == 200
