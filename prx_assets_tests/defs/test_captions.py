"""The captions asset in Dagster: materialised with the image stage, versions as code versions,
and the re-captioning sensor and schedule evaluated with Dagster's built contexts."""

import dagster as dg
import lance

from prx_assets.definitions import build_defs
from prx_assets.testing.dagster_results import checks
from prx_assets.testing.images import jpeg_bytes
from prx_assets.testing.sources import write_sources


def materializations(result) -> dict:
    return {e.event_specific_data.materialization.asset_key.path[-1]:
            e.event_specific_data.materialization.metadata
            for e in result.get_asset_materialization_events()}


def closing_lines(instance, run_id: str) -> dict[str, str]:
    """stage -> its closing progress line (StageProgress), from the run's event log."""
    lines = {}
    for entry in instance.all_logs(run_id):
        message = entry.user_message or ""
        stage, _, rest = message.partition(": ")
        if "; done in " in rest and "[" in stage:
            lines[stage] = rest
    return lines


def test_captions_asset_sensor_and_schedule(ray_session, data_root, tmp_path):
    # A persistent test instance: schedule contexts with resources need an instance ref.
    with dg.instance_for_test() as instance:
        run_captions_scenario(instance, data_root, tmp_path)


def run_captions_scenario(instance, data_root, tmp_path):
    folder = tmp_path / "imgs"
    folder.mkdir()
    for i in range(4):
        (folder / f"p{i}.jpg").write_bytes(jpeg_bytes(700 + 40 * i, 560, i))
        if i < 3:
            (folder / f"p{i}.txt").write_text(f"A red and grey pattern, number {i}.")
    (folder / "tiny.jpg").write_bytes(jpeg_bytes(120, 120, 9))  # rejected: never captioned
    sources = write_sources(tmp_path / "s.yaml", [
        f"{{name: web, kind: image_folder, uri: {folder}}}",
        f"{{name: other, kind: image_folder, uri: {tmp_path / 'missing'}}}"])
    captioner_file = tmp_path / "captioner.yaml"
    defs = build_defs(sources, captioner_file)

    sensor = defs.get_sensor_def("recaption_sensor")
    schedule = defs.get_schedule_def("recaption_schedule")
    resources = {"captioner": defs.resources["captioner"]}

    def sensor_partitions(definitions=defs):
        context = dg.build_sensor_context(
            instance=instance, resources={"captioner": definitions.resources["captioner"]})
        result = definitions.get_sensor_def("recaption_sensor")(context)
        if isinstance(result, dg.SkipReason):
            return {}
        return {r.partition_key: r.tags["prx/recaption_reason"] for r in result}

    assert sensor_partitions() == {}  # nothing has images yet: nothing to caption

    images = defs.resolve_job_def("source_job").execute_in_process(
        partition_key="web", instance=instance,
        asset_selection=[dg.AssetKey("raw_images"), dg.AssetKey("bucketed_images"),
                         dg.AssetKey("phashes")])
    assert images.success
    # Each stage closes with one progress line, with a total where it is cheap to count.
    progress = closing_lines(instance, images.run_id)
    assert progress["raw_images[web]"].startswith("5 rows, ")
    assert progress["bucketed_images[web]"].startswith("5 / 5 images (100%), ")
    assert sensor_partitions() == {"web": "missing"}  # "other" has no images: not requested

    run = defs.resolve_job_def("captions_job").execute_in_process(partition_key="web",
                                                                   instance=instance)
    assert run.success
    assert closing_lines(instance, run.run_id)["captions[web]"].startswith(
        "4 / 4 images (100%), ")
    meta = materializations(run)["captions"]
    version = defs.resources["captioner"].produced_version()
    assert meta["caption_version"].value == version
    assert meta["kept_images"].value == 4 and meta["coverage"].value == 1.0
    assert (meta["rows_processed"].value, meta["rows_reused"].value,
            meta["rows_removed"].value) == (4, 0, 0)
    statuses = {r.data["status"]: r.data["count"] for r in meta["rows_by_status"].value.records}
    assert statuses == {"ok": 3, "empty": 1}
    assert outcome_of(checks(run)) == {"coverage": True, "length_in_target": True,
                                       "failure_share": True}
    rows = lance.dataset(str(data_root / "lance/captions/web.lance")).to_table().to_pylist()
    assert sorted(r["caption"] or "" for r in rows)[1:] == [
        f"A red and grey pattern, number {i}." for i in range(3)]
    assert meta["lance_version"].value == lance.dataset(
        str(data_root / "lance/captions/web.lance")).version
    assert sensor_partitions() == {}  # current

    # The caption version is the asset's code version: a new config makes it stale.
    captions_node = defs.resolve_asset_graph().get(dg.AssetKey("captions"))
    assert captions_node.code_version == version
    captioner_file.write_text("backend: openai\nmodel: qwen3-vl\nendpoint: http://127.0.0.1:9/v1\n")
    new_defs = build_defs(sources, captioner_file)
    new_version = new_defs.resources["captioner"].produced_version()
    assert new_version != version
    assert new_defs.resolve_asset_graph().get(dg.AssetKey("captions")).code_version == new_version
    assert sensor_partitions(new_defs) == {"web": "new caption version"}

    # The image stage run again over the same images changes nothing: captions stay current.
    image_stage = [dg.AssetKey(k) for k in ("raw_images", "bucketed_images", "phashes")]
    again = defs.resolve_job_def("source_job").execute_in_process(
        partition_key="web", instance=instance, asset_selection=image_stage)
    assert again.success
    assert materializations(again)["bucketed_images"]["rows_processed"].value == 0
    assert sensor_partitions() == {}
    # New images make the old version's partition stale too.
    (folder / "p9.jpg").write_bytes(jpeg_bytes(720, 560, 19))
    again = defs.resolve_job_def("source_job").execute_in_process(
        partition_key="web", instance=instance, asset_selection=image_stage)
    assert again.success
    assert sensor_partitions() == {"web": "new images"}

    # The schedule requests the same partitions, one run each, in the captions job.
    with dg.build_schedule_context(instance=instance, resources=resources,
                                   repository_def=defs.get_repository_def()) as context:
        requests = schedule.evaluate_tick(context).run_requests
    assert [(r.partition_key, r.tags["prx/recaption_reason"]) for r in requests] == \
        [("web", "new images")]
    assert sensor.default_status == dg.DefaultSensorStatus.STOPPED
    assert schedule.default_status == dg.DefaultScheduleStatus.STOPPED


def outcome_of(check_results: dict) -> dict:
    return {name.split(":")[1]: passed for name, passed in check_results.items()
            if name.startswith("captions:")}


def test_a_replaced_file_is_captioned_again_after_raw_frees_old_versions(
        ray_session, data_root, tmp_path):
    """Captions find changed items by comparing the raw_images version they last read
    with the current one; raw_images frees superseded versions after a short grace, so
    the version captions read must outlive it (it is held for them)."""
    from datetime import timedelta

    from prx_assets.storage.layout import Storage
    from prx_assets.storage.retention import drop_superseded

    folder = tmp_path / "imgs"
    folder.mkdir()
    for i in range(2):
        (folder / f"p{i}.jpg").write_bytes(jpeg_bytes(700, 560, i))
        (folder / f"p{i}.txt").write_text(f"A red and grey pattern, number {i}.")
    defs = build_defs(write_sources(tmp_path / "s.yaml", [
        f"{{name: web, kind: image_folder, uri: {folder}}}"]), tmp_path / "captioner.yaml")
    job = defs.resolve_job_def("source_job")
    keys = [dg.AssetKey(k) for k in ("raw_images", "bucketed_images", "phashes", "captions")]

    def run(selection):
        result = job.execute_in_process(partition_key="web", instance=instance,
                                        asset_selection=selection)
        assert result.success
        return materializations(result)

    with dg.instance_for_test() as instance:
        run(keys)
        (folder / "p1.jpg").write_bytes(jpeg_bytes(720, 560, 5))  # replaced in place
        (folder / "p1.txt").write_text("A new picture under the old name.")
        run(keys[:1])  # a sensor ingests it; the grace passes before the rest runs
        raw = Storage(str(data_root)).table("raw_images", "web")
        drop_superseded(raw.latest().open(), timedelta(0))
        meta = run(keys[1:])["captions"]
    assert meta["stale_captions_dropped"].value == 1
    # The versions the run read were held while it ran, and let go after.
    for name in ("raw_images", "bucketed_images"):
        tags = lance.dataset(str(data_root / f"lance/{name}/web.lance")).tags.list()
        assert "prx-held-by-captions-run" not in tags
    captions = lance.dataset(str(data_root / "lance/captions/web.lance")).to_table()
    assert sorted(captions.column("caption").to_pylist()) == [
        "A new picture under the old name.", "A red and grey pattern, number 0."]


def tiny_vlm_defs(tmp_path):
    """The definitions with a tiny random Qwen3-VL under transformers as the captioner, and
    one source of two images; returns them and the source's folder."""
    from prx_assets.testing.tiny_vlm import build_tiny_qwen3_vl

    model = build_tiny_qwen3_vl(tmp_path / "tiny-qwen3-vl")
    captioner = tmp_path / "captioner.yaml"
    captioner.write_text(f"backend: transformers\nmodel: {model}\nmax_tokens: 12\n"
                         "temperature: 0.0\nimage_budget: 9216\nbatch_size: 2\n"
                         "concurrency: 1\n")
    folder = tmp_path / "imgs"
    folder.mkdir()
    for i in range(2):
        (folder / f"p{i}.jpg").write_bytes(jpeg_bytes(700, 560, i))
    return build_defs(write_sources(tmp_path / "s.yaml", [
        f"{{name: web, kind: image_folder, uri: {folder}}}"]), captioner), folder


def test_a_model_backend_captions_only_new_images_by_id(ray_session, data_root, tmp_path):
    """A model backend (a tiny random Qwen3-VL under transformers): the first run captions
    every kept image; after one more file, the next captions just that one, its bytes read
    by id (`pending_ids`, `requests_for`)."""
    defs, folder = tiny_vlm_defs(tmp_path)
    keys = [dg.AssetKey(k) for k in ("raw_images", "bucketed_images", "phashes", "captions")]

    def run() -> dict:
        result = defs.resolve_job_def("source_job").execute_in_process(
            partition_key="web", instance=instance, asset_selection=keys)
        assert result.success
        return materializations(result)["captions"]

    with dg.instance_for_test() as instance:
        assert run()["rows_processed"].value == 2
        (folder / "p2.jpg").write_bytes(jpeg_bytes(720, 560, 2))
        meta = run()
    assert (meta["rows_processed"].value, meta["rows_reused"].value) == (1, 2)
    rows = lance.dataset(str(data_root / "lance/captions/web.lance")).to_table().to_pylist()
    assert len(rows) == len({r["id"] for r in rows}) == 3  # each image once
    assert {r["caption_version"] for r in rows} == {meta["caption_version"].value}


def test_a_model_backend_waits_for_the_new_image_of_a_replaced_file(
        ray_session, data_root, tmp_path):
    """A file replaced in place, captions run before the image stage, without a record of
    bucketed (as a first run, a new caption version or after a compaction of bucketed
    compare every id): the stale caption is dropped, but the old image is not captioned
    again; once the image stage made the new image, it is captioned, once."""
    from prx_assets.storage.changes import forget_consumed
    from prx_assets.storage.refs import TableRef
    defs, folder = tiny_vlm_defs(tmp_path)
    keys = [dg.AssetKey(k) for k in ("raw_images", "bucketed_images", "phashes", "captions")]
    captions = TableRef.of(data_root / "lance/captions/web.lance")

    def run(selection) -> dict:
        result = defs.resolve_job_def("source_job").execute_in_process(
            partition_key="web", instance=instance, asset_selection=selection)
        assert result.success
        return materializations(result)

    with dg.instance_for_test() as instance:
        run(keys)
        (folder / "p1.jpg").write_bytes(jpeg_bytes(720, 560, 7))  # replaced in place
        run(keys[:1])
        forget_consumed(captions)  # every id compared
        meta = run(keys[3:])["captions"]
        assert (meta["stale_captions_dropped"].value, meta["rows_processed"].value) == (1, 0)
        assert captions.latest().count_rows() == 1  # p0's; p1 waits for its new image
        after = run(keys[1:])["captions"]
    assert after["rows_processed"].value == 1
    assert captions.latest().count_rows() == 2
