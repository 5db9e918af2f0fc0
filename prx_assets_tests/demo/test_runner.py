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


def _skipped_share_metadata(streams: list[tuple[str, int, int]], over: list[str],
                            over_by_reason: dict, per_reason: list[tuple[str, int, str]]
                            ) -> dict:
    """What skip_lists:skipped_share records, as check_results reads it back."""
    return {"warn_above": 0.1, "streams_over": ", ".join(over) or "none",
            "over_by_reason": over_by_reason,
            "per_stream": dg.MetadataValue.table([dg.TableRecord(
                {"stream": s, "samples": n, "skipped": k, "share": k / n})
                for s, n, k in streams]),
            "per_reason": dg.MetadataValue.table([dg.TableRecord(
                {"reason": r, "samples": n, "share": 0.0, "applied": a})
                for r, n, a in per_reason])}


def test_the_skipped_share_warning_is_explained_from_what_tripped_it():
    from prx_assets.demo.runner import SKIPPED_SHARE, skipped_share_explanation

    small = _skipped_share_metadata(
        [("512/a", 4, 1), ("1024/b", 9, 2), ("1024/c", 40, 1)], ["512/a", "1024/b"],
        {"dedup": 2, "semdedup": 1},
        [("dedup", 3, "by default"), ("semdedup", 1, "by default"),
         ("balance", 122, "opt-in (when a run names it)")])
    why = skipped_share_explanation(small)
    assert why.startswith("tripped by dedup 2, semdedup 1 in 2 stream(s); 2 of them hold 4-9 "
                          "samples, where one skipped sample is over 10%; not counted: the "
                          "opt-in balance 122; ")
    # A big stream over the bound: no excuse of size, and no opt-in list to mention.
    big = _skipped_share_metadata([("1024/d", 500, 90)], ["1024/d"], {"optout": 90},
                                  [("optout", 90, "by default")])
    assert skipped_share_explanation(big) == (
        "tripped by optout 90 in 1 stream(s); a stream of real size over the bound: "
        "rewrite_shards_job (bound: SkipShareConfig.warn_above)")
    runs = [PartitionRun("demo_a", True, "r1", checks={SKIPPED_SHARE: "failed (WARN)"},
                         check_notes={SKIPPED_SHARE: "rewrite recommended"},
                         check_metadata={SKIPPED_SHARE: big})]
    assert check_lines(runs)[2:] == [
        "      demo_a: failed (WARN): rewrite recommended",
        f"      -> {skipped_share_explanation(big)}"]


def test_the_semantic_share_and_the_balance_list_are_explained_from_the_figures():
    from prx_assets.demo.runner import balance_explanation, semantic_explanation

    semantic = {"removed": 228, "embeddings": 259, "eps": 0.05, "applied_by_skip_lists": False}
    assert semantic_explanation(semantic, 133).startswith(
        "88% because in the caption space an image is its caption: 126 of the 228 repeat "
        "another sample's caption word for word (crops of a few photos share one), the other "
        "102 are worded within cosine 0.95 of one; reported only")
    assert semantic_explanation({**semantic, "applied_by_skip_lists": True}, 31) is None
    assert balance_explanation({"samples": 259, "balanced_samples": 137}).startswith(
        "the other 122 of 259 make the opt-in `balance` list: the loader skips them only "
        "when a run names it")
    assert balance_explanation({}) is None


@dg.asset_check(asset=chatty)
def chatty_warns() -> dg.AssetCheckResult:
    return dg.AssetCheckResult(passed=False, severity=dg.AssetCheckSeverity.WARN,
                               metadata={"over_by_reason": dg.MetadataValue.json({"dedup": 2})})


@dg.asset_check(asset=chatty)
def chatty_fine() -> dg.AssetCheckResult:
    return dg.AssetCheckResult(passed=True, metadata={"n": 1})


def test_a_run_keeps_the_metadata_of_the_checks_that_did_not_pass():
    from prx_assets.demo.runner import _partition_run

    job = dg.Definitions(assets=[chatty], asset_checks=[chatty_warns, chatty_fine]
                         ).resolve_implicit_global_asset_job_def()
    run = _partition_run("demo_a", _run(job, dg.DagsterInstance.ephemeral()))
    assert run.checks == {"chatty:chatty_warns": "failed (WARN)",
                          "chatty:chatty_fine": "passed"}
    assert run.check_metadata == {"chatty:chatty_warns": {"over_by_reason": {"dedup": 2}}}
