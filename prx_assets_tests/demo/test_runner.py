"""The demo runner: a console a person can read, an event log that keeps everything, and a
closing summary that says why each check that did not pass warned."""

import logging

import dagster as dg

from prx_assets.demo.runner import DEMO_NOTES, PartitionRun, _run, check_lines, with_console_level


@dg.asset
def chatty(context: dg.AssetExecutionContext) -> int:
    context.log.debug("a debug line from the asset")
    context.log.info("an info line from the asset")
    return 1


def test_console_shows_info_while_the_event_log_keeps_every_event(capfd):
    instance = dg.DagsterInstance.ephemeral()
    job = dg.Definitions(assets=[chatty]).resolve_implicit_global_asset_job_def()
    result = _run(job, instance)
    assert result.success
    console = capfd.readouterr().err
    assert "an info line from the asset" in console
    assert "a debug line from the asset" not in console
    assert "STEP_START" not in console  # Dagster's DEBUG events stay off the console
    logged = instance.all_logs(result.run_id)
    assert any(e.user_message == "a debug line from the asset" for e in logged)
    steps = [e for e in logged if e.dagster_event and e.dagster_event.event_type_value
             == "STEP_START"]
    assert steps and steps[0].level == logging.DEBUG


def test_a_run_config_keeps_its_own_logger_settings():
    mine = {"loggers": {"console": {"config": {"log_level": "DEBUG"}}}, "ops": {"x": {}}}
    assert with_console_level(mine) == mine
    assert with_console_level({"ops": {}})["loggers"]["console"]["config"]["log_level"] == "INFO"


def test_summary_explains_each_check_that_warned():
    runs = [
        PartitionRun("demo_a", True, "r1", checks={
            "caption_labels:label_shares": "failed (WARN)", "raw_images:ids_unique": "passed"},
            check_notes={"caption_labels:label_shares": "text 14.0% > bound 10% of the labelled "
                                                        "captions"}),
        PartitionRun("demo_b", True, "r2", checks={
            "caption_labels:label_shares": "failed (WARN)", "other:check": "failed (ERROR)"},
            check_notes={"caption_labels:label_shares": "nsfw 3.0% > bound 2% of the labelled "
                                                        "captions", "other:check": "x 1"}),
    ]
    assert check_lines(runs) == [
        "checks: 1 of 4 passed; 3 did not:",
        "   caption_labels:label_shares",
        "      demo_a: failed (WARN): text 14.0% > bound 10% of the labelled captions",
        "      demo_b: failed (WARN): nsfw 3.0% > bound 2% of the labelled captions",
        f"      -> {DEMO_NOTES['caption_labels:label_shares']}",
        "   other:check",
        "      demo_b: failed (ERROR): x 1",
    ]
    passing = [PartitionRun("demo_a", True, "r1", checks={"a:b": "passed"})]
    assert check_lines(passing) == ["checks: 1 of 1 passed"]


def test_the_demo_portrait_is_labelled_visual_and_the_note_no_longer_excuses_it():
    """The embedded classifier once labelled the demo's portrait in a naval uniform nsfw and
    the demo explained the warning away; the classifier is fixed, the excuse is gone."""
    from prx_assets.demo.corpus import PHOTO_CAPTIONS
    from prx_assets.models.embeddings import MiniLMEmbedder
    from prx_assets.stages.labels.labels import load_embedded_classifier

    caption = PHOTO_CAPTIONS["grace_hopper"]
    assert caption.startswith("A woman in a dark naval uniform")
    assert "naval" not in DEMO_NOTES["caption_labels:label_shares"]
    labels = load_embedded_classifier().predict(MiniLMEmbedder(threads=1).embed([caption]))
    assert labels == ["visual"]
