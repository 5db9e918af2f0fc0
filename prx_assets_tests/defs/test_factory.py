"""The factory runs itself: the source sensor (built contexts) and the automation that
carries a raw_images update downstream (`evaluate_automation_conditions`)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import dagster as dg
import pytest

from prx_assets.definitions import build_defs
from prx_assets.defs.factory import (
    AUTOMATED,
    GROUP_SENSOR,
    REASON_TAG,
    TRIGGER_TAG,
    sensor_name,
    skip_lists_due,
)
from prx_assets.defs.resources import StorageResource
from prx_assets.stages.dedup.dedup import DUPLICATES_SCHEMA
from prx_assets.stages.ingest import readers
from prx_assets.storage.changes import record_groups_changed
from prx_assets.storage.lance_tables import overwrite_rows
from prx_assets.storage.layout import Storage
from prx_assets.testing.sources import write_sources


@pytest.fixture()
def source(tmp_path: Path) -> tuple[Path, dg.Definitions]:
    folder = tmp_path / "web"
    (folder / "sub").mkdir(parents=True)
    for name in ("a.jpg", "b.jpg", "sub/c.jpg"):
        (folder / name).write_bytes(name.encode())
    sources = write_sources(tmp_path / "sources.yaml",
                            [f"{{name: web, kind: image_folder, uri: {folder}}}"])
    return folder, build_defs(sources)


def tick(defs: dg.Definitions, cursor: str | None):
    sensor = defs.get_sensor_def(sensor_name("web"))
    with dg.instance_for_test() as instance:
        return sensor(dg.build_sensor_context(cursor=cursor, instance=instance))


def requested(result) -> dg.RunRequest:
    assert isinstance(result, dg.SensorResult), result
    (request,) = result.run_requests
    assert isinstance(request, dg.RunRequest)
    assert request.partition_key == "web"
    assert request.asset_selection == [dg.AssetKey("raw_images")]
    assert request.tags[TRIGGER_TAG] == "web_source_sensor"
    return request


def test_the_source_sensor_requests_a_run_when_a_file_is_added_removed_or_rewritten(source):
    folder, defs = source
    first = tick(defs, None)
    assert "3 unit(s)" in requested(first).tags[REASON_TAG]
    cursor = first.cursor
    assert isinstance(tick(defs, cursor), dg.SkipReason)  # nothing changed

    (folder / "d.jpg").write_bytes(b"d")
    added = tick(defs, cursor)
    assert "3 -> 4 unit(s)" in requested(added).tags[REASON_TAG]
    assert requested(added).run_key != requested(first).run_key

    # One removed, one added: the count stays, the listing does not.
    (folder / "a.jpg").unlink()
    (folder / "sub" / "e.jpg").write_bytes(b"e")
    swapped = tick(defs, added.cursor)
    assert "some added, removed or rewritten" in requested(swapped).tags[REASON_TAG]

    # Rewritten with its old modification time kept: the size changed.
    stat = (folder / "b.jpg").stat()
    (folder / "b.jpg").write_bytes(b"a longer b")
    os.utime(folder / "b.jpg", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    requested(tick(defs, swapped.cursor))

    # Copied in with an old mtime preserved (`cp -p`): the newest mtime is the same.
    shutil.copy2(folder / "sub" / "c.jpg", folder / "old.jpg")
    requested(tick(defs, swapped.cursor))


def test_a_failed_listing_requests_nothing_and_keeps_the_cursor(source, monkeypatch):
    folder, defs = source
    cursor = tick(defs, None).cursor
    (folder / "sub" / "c.jpg").unlink()  # a real change, behind a folder that fails to list
    scandir = readers.os.scandir

    def refusing(path):
        if not isinstance(path, int) and Path(path) == folder / "sub":
            raise PermissionError(13, "Permission denied", str(path))
        return scandir(path)

    monkeypatch.setattr(readers.os, "scandir", refusing)
    skipped = tick(defs, cursor)
    assert isinstance(skipped, dg.SkipReason) and "Permission denied" in skipped.skip_message
    monkeypatch.undo()
    assert "3 -> 2 unit(s)" in requested(tick(defs, cursor)).tags[REASON_TAG]


def test_factory_is_off_by_default_and_on_with_one_setting(source, monkeypatch, tmp_path):
    _, defs = source
    names = [sensor_name("web"), "factory_automation"]
    for name in names:
        assert defs.get_sensor_def(name).default_status == dg.DefaultSensorStatus.STOPPED
    monkeypatch.setenv("PRX_FACTORY", "on")
    on = build_defs(tmp_path / "sources.yaml")
    for name in names:
        assert on.get_sensor_def(name).default_status == dg.DefaultSensorStatus.RUNNING


def test_a_raw_images_update_is_carried_downstream_by_automation(source):
    _, defs = source
    with dg.instance_for_test() as instance:
        first = dg.evaluate_automation_conditions(defs=defs, instance=instance)
        # Nothing materialised yet: every automated asset waits on a missing upstream.
        assert first.total_requested == 0
        instance.report_runless_asset_event(
            dg.AssetMaterialization("raw_images", partition="web"))
        after = dg.evaluate_automation_conditions(defs=defs, instance=instance,
                                                  cursor=first.cursor)
        # The per-source chain in one tick, skip lists included: an asset whose upstream is
        # requested in the same tick counts that upstream as coming.
        assert automated(after) == {name: {"web"} for name in (*PER_SOURCE_CHAIN, "skip_lists")}
        for name in (*PER_SOURCE_CHAIN, "skip_lists"):
            instance.report_runless_asset_event(dg.AssetMaterialization(name, partition="web"))
        # Then the global duplicates (over every source's phashes).
        dedup = dg.evaluate_automation_conditions(defs=defs, instance=instance,
                                                  cursor=after.cursor)
        assert automated(dedup) == {"duplicates": {None}}
        # Its update starts no skip lists by itself: the group change sensor starts those of
        # the sources whose groups it changed (test_group_change_sensor_...).
        instance.report_runless_asset_event(dg.AssetMaterialization("duplicates"))
        skip = dg.evaluate_automation_conditions(defs=defs, instance=instance,
                                                 cursor=dedup.cursor)
        assert automated(skip) == {}
        # Everything built, then raw_images alone changes (a re-ingest whose only news is
        # provenance, say): the chain runs again up to the tree and its skip lists; the
        # tree's incremental build then compares raw_images (the automation cannot know
        # what changed).
        instance.report_runless_asset_event(
            dg.AssetMaterialization("raw_images", partition="web"))
        again = dg.evaluate_automation_conditions(defs=defs, instance=instance,
                                                  cursor=skip.cursor)
        assert automated(again) == {name: {"web"} for name in (*PER_SOURCE_CHAIN, "skip_lists")}


def test_skip_lists_are_due_where_groups_changed_after_the_version_they_read():
    changed_at = {"web": 5, "stock": 9, "books": 9}
    applied = {"web": 7, "stock": 8, "books": None}
    assert skip_lists_due(changed_at, applied, ["web", "stock", "books", "gone"]) == [
        "stock", "books"]
    assert skip_lists_due(changed_at, {**applied, "stock": 9, "books": 12},
                          ["web", "stock", "books"]) == []
    assert skip_lists_due({}, {}, ["web"]) == []  # a step that records no change


def test_group_change_sensor_requests_the_skip_lists_of_changed_sources_only(
        source, tmp_path):
    """A new tar that joins no group of another source records no change for it (stage
    test: test_an_update_records_the_sources_whose_groups_changed_and_only_those): its
    skip lists are not requested; the sources whose groups changed are, once."""
    _, defs = source
    table = Storage(tmp_path / "data").table("duplicates")
    overwrite_rows(table, DUPLICATES_SCHEMA.empty_table(), DUPLICATES_SCHEMA)
    sensor = defs.get_sensor_def(GROUP_SENSOR)
    resources = {"storage": StorageResource(root=str(tmp_path / "data"))}
    with dg.instance_for_test() as instance:
        def tick():
            return sensor(dg.build_sensor_context(instance=instance, resources=resources))

        assert isinstance(tick(), dg.SkipReason)  # no change recorded
        record_groups_changed(table, ["web", "gone"], 4)
        (request,) = tick().run_requests
        assert request.partition_key == "web" and request.run_key == "groups:web:duplicates@4"
        assert request.asset_selection == [dg.AssetKey("skip_lists")]
        assert request.tags[TRIGGER_TAG] == GROUP_SENSOR
        instance.report_runless_asset_event(dg.AssetMaterialization(
            "skip_lists", partition="web", metadata={"input_version/duplicates": 4}))
        assert isinstance(tick(), dg.SkipReason)  # read it already



def test_semantic_duplicates_follow_every_sources_embeddings(source):
    """Automated once each source has embeddings (run by hand or by a job): an update then
    regroups only the clusters the new vectors touch."""
    _, defs = source
    with dg.instance_for_test() as instance:
        for name in ("raw_images", *PER_SOURCE_CHAIN):
            instance.report_runless_asset_event(dg.AssetMaterialization(name, partition="web"))
        instance.report_runless_asset_event(dg.AssetMaterialization("duplicates"))
        before = dg.evaluate_automation_conditions(defs=defs, instance=instance)
        assert "semantic_duplicates" not in automated(before)  # no embeddings yet
        instance.report_runless_asset_event(
            dg.AssetMaterialization("image_embeddings", partition="web"))
        after = dg.evaluate_automation_conditions(defs=defs, instance=instance,
                                                  cursor=before.cursor)
        assert automated(after)["semantic_duplicates"] == {None}


PER_SOURCE_CHAIN = ("bucketed_images", "phashes", "captions", "caption_labels", "mds_shards")


def automated(result) -> dict[str, set]:
    """asset -> partitions the evaluation requested (None: an unpartitioned asset)."""
    found = {}
    for key in map(dg.AssetKey, AUTOMATED):
        partitions = result.get_requested_partitions(key)
        if partitions:
            found[key.to_user_string()] = partitions
    return found


def test_the_source_sensors_interval_is_a_setting(source, monkeypatch, tmp_path):
    _, defs = source
    assert defs.get_sensor_def(sensor_name("web")).minimum_interval_seconds == 300
    monkeypatch.setenv("PRX_SOURCE_SENSOR_INTERVAL_S", "20")
    faster = build_defs(tmp_path / "sources.yaml")
    assert faster.get_sensor_def(sensor_name("web")).minimum_interval_seconds == 20
    monkeypatch.setenv("PRX_SOURCE_SENSOR_INTERVAL_S", "soon")
    with pytest.raises(ValueError, match="PRX_SOURCE_SENSOR_INTERVAL_S='soon'"):
        build_defs(tmp_path / "sources.yaml")


def test_trees_and_skip_lists_have_a_freshness_policy(source):
    _, defs = source
    graph = defs.resolve_asset_graph()
    for key in ("mds_shards", "skip_lists"):
        policy = graph.get(dg.AssetKey(key)).freshness_policy
        assert policy is not None and policy.fail_window.to_timedelta().days == 3, key
    assert graph.get(dg.AssetKey("raw_images")).freshness_policy is None


def test_a_failed_run_is_logged_in_one_line_naming_the_step_and_cause():
    from prx_assets.defs.factory import describe_failure, failure_line, run_failure_reporter

    @dg.op
    def fetch() -> None:
        raise OSError("bucket answered 403 Forbidden\nsecond line")

    @dg.job
    def broken() -> None:
        fetch()

    with dg.instance_for_test() as instance:
        result = broken.execute_in_process(instance=instance, raise_on_error=False)
        failure = next(e for e in result.all_events if e.event_type_value == "PIPELINE_FAILURE")
        context = dg.build_run_status_sensor_context(
            sensor_name="run_failure_reporter", dagster_event=failure,
            dagster_instance=instance, dagster_run=result.dagster_run).for_run_failure()
        line = describe_failure(context)
        run_failure_reporter(context)  # logs that line
    assert line == (f"run {result.run_id} of broken failed at step fetch: OSError: bucket "
                    "answered 403 Forbidden")
    assert failure_line("r", "j", [], "run worker crashed") == \
        "run r of j failed at step (no step): run worker crashed"
