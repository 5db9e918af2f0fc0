import io
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import dagster as dg
import lance
import pytest

from prx_assets.definitions import build_defs
from prx_assets.stages.ingest.ids import sample_id
from prx_assets.testing.dagster_results import checks
from prx_assets.testing.images import jpeg_bytes
from prx_assets.testing.sources import write_sources


@pytest.fixture()
def two_sources(tmp_path: Path, small_folder: Path) -> Path:
    wds = tmp_path / "wds"
    wds.mkdir()
    with tarfile.open(wds / "shard-0.tar", "w") as tar:
        for i in range(6):
            for name, data in ((f"{i:03d}.jpg", jpeg_bytes(500, 400, i)), (f"{i:03d}.txt", b"cap")):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return write_sources(tmp_path / "sources.yaml", [
        f"{{name: web, kind: image_folder, uri: {small_folder}}}",
        f"{{name: tars, kind: webdataset, uri: {wds}}}",
        "{name: gone, kind: image_folder, uri: /nonexistent/images}",
    ])


def run_partition(sources: Path, partition: str, instance: dg.DagsterInstance):
    """Ingest only (with its checks): later stages have their own tests."""
    job = build_defs(sources).resolve_job_def("source_job")
    return job.execute_in_process(partition_key=partition, instance=instance, raise_on_error=False,
                                  asset_selection=[dg.AssetKey("raw_images")])


def materialization(result, asset: str = "raw_images") -> dict:
    events = [e.materialization for e in result.get_asset_materialization_events()
              if e.materialization.asset_key.path[-1] == asset]
    assert len(events) == 1
    return {k: v.value for k, v in events[0].metadata.items()}


def test_partitions_materialise_independently_with_checks_and_metadata(
        ray_session, data_root, two_sources):
    instance = dg.DagsterInstance.ephemeral()
    web = run_partition(two_sources, "web", instance)
    assert web.success
    meta = materialization(web)
    assert meta["dagster/row_count"] == 8 and meta["ok_rows"] == 3
    assert meta["lance_version"] >= 1 and meta["fragments"] == 1
    reasons = {r.data["reason"]: r.data["count"] for r in meta["rejects_by_reason"].records}
    assert reasons == {"unsupported_format": 1, "truncated": 1, "unreadable": 1,
                       "empty_file": 1, "not_an_image": 1}
    assert {r.data["format"] for r in meta["formats"].records} == {"JPEG", "PNG", "WEBP", "GIF"}
    # Sizes in words, and the resolution bands as bar charts the asset page draws inline
    # (Markdown under the UI's 1,000-character limit).
    assert re.fullmatch(r"[0-9.]+ (B|KB|MB)", meta["table_size"])
    for chart, title in (("megapixels_chart", "decodable images by megapixels"),
                         ("aspect_ratios_chart", "decodable images by width / height")):
        assert meta[chart].startswith(f"**{title}**") and "█" in meta[chart]
        assert len(meta[chart]) < 1000
    raw_checks = {k: v for k, v in checks(web).items() if k.startswith("raw_images:")}
    assert raw_checks == {"raw_images:ids_unique": True, "raw_images:fragments_healthy": True,
                          "raw_images:reject_share": False}  # 5 of 8 rows rejected: warns

    tars = run_partition(two_sources, "tars", instance)
    assert tars.success and materialization(tars)["dagster/row_count"] == 6
    tars_uri = data_root / "lance/raw_images/tars.lance"
    tars_version = lance.dataset(str(tars_uri)).version

    again = run_partition(two_sources, "web", instance)
    assert again.success
    assert lance.dataset(str(data_root / "lance/raw_images/web.lance")).count_rows() == 8
    assert lance.dataset(str(tars_uri)).version == tars_version  # other source untouched
    # Tables and the writers' leases (released: expired copies, none live); no scratch.
    assert sorted(p.name for p in data_root.iterdir()) == ["lance", "leases"]


def test_missing_source_path_fails_that_partition_clearly(ray_session, data_root, two_sources):
    result = run_partition(two_sources, "gone", dg.DagsterInstance.ephemeral())
    assert not result.success
    failure = result.failure_data_for_node("raw_images")
    message = failure.error.message
    assert "source 'gone'" in message and "/nonexistent/images" in message


@pytest.mark.e2e  # `dagster definitions validate` in a subprocess
def test_code_location_validates_from_the_workspace():
    root = Path(__file__).parents[2]
    dagster = Path(sys.executable).parent / "dagster"
    result = subprocess.run([str(dagster), "definitions", "validate", "-w", "workspace.yaml"],
                            cwd=root, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


# ------------------------------------------------------------------ incremental reruns

def data_version(result, asset: str = "raw_images") -> str:
    [event] = [e.materialization for e in result.get_asset_materialization_events()
               if e.materialization.asset_key.path[-1] == asset]
    return event.tags["dagster/data_version"]


def counts(meta: dict) -> tuple[int, int, int]:
    return meta["rows_processed"], meta["rows_reused"], meta["rows_removed"]


def test_reruns_report_what_changed_and_keep_the_data_version_when_nothing_did(
        ray_session, data_root, tmp_path):
    folder = tmp_path / "imgs"
    folder.mkdir()
    for i in range(4):
        (folder / f"{i}.jpg").write_bytes(jpeg_bytes(480, 400, i))
    sources = write_sources(tmp_path / "sources.yaml",
                            [f"{{name: web, kind: image_folder, uri: {folder}}}"])
    instance = dg.DagsterInstance.ephemeral()
    first = run_partition(sources, "web", instance)
    assert first.success
    meta = materialization(first)
    assert counts(meta) == (4, 0, 0) and meta["dagster/row_count"] == 4 and meta["ok_rows"] == 4
    assert meta["path"] == str(data_root / "lance/raw_images/web.lance") and meta["fragments"] == 1
    assert meta["ray_nodes"] == 1 and meta["units_read"] == 4

    same = run_partition(sources, "web", instance)
    assert same.success and counts(materialization(same)) == (0, 4, 0)
    assert materialization(same)["lance_version"] == meta["lance_version"]
    assert data_version(same) == data_version(first)

    (folder / "new.jpg").write_bytes(jpeg_bytes(500, 400, 9))
    (folder / "0.jpg").unlink()
    changed = run_partition(sources, "web", instance)
    assert changed.success
    after = materialization(changed)
    assert counts(after) == (1, 3, 1) and after["dagster/row_count"] == 4
    assert after["lance_version"] > meta["lance_version"]
    assert data_version(changed) != data_version(first)

    # Downstream loads raw_images through the IO manager, pinned to the recorded version.
    job = build_defs(sources).resolve_job_def("source_job")
    images = job.execute_in_process(
        partition_key="web", instance=instance, raise_on_error=False,
        asset_selection=[dg.AssetKey(k) for k in ("bucketed_images", "phashes")])
    assert images.success
    assert materialization(images, "bucketed_images")["input_version/raw_images"] == \
        after["lance_version"]
    ids = lance.dataset(str(data_root / "lance/bucketed_images/web.lance")).to_table(
        columns=["id"]).column(0).to_pylist()
    assert sorted(ids) == sorted(sample_id("web", n) for n in ("1.jpg", "2.jpg", "3.jpg",
                                                              "new.jpg"))


@pytest.mark.e2e  # a run in a subprocess, killed
def test_a_run_killed_after_a_chunk_commit_resumes_with_only_the_rest(
        ray_session, data_root, tmp_path):
    """SIGKILL of the run's whole process group right after its first chunk committed (the
    `ingest.chunk_committed` failpoint holds the driver there); the rerun reads only the
    units not committed, and the table equals a fresh full run's."""
    from prx_assets.testing.fault_runs import (
        RunProcess,
        RunSpec,
        mark_killed_run_failed,
        open_instance,
        table_state,
        wait_for_failpoint,
        write_instance_config,
    )

    folder = tmp_path / "imgs"
    folder.mkdir()
    total = 12
    for i in range(total):
        (folder / f"{i:02d}.jpg").write_bytes(jpeg_bytes(480, 400, i))
    sources = write_sources(tmp_path / "sources.yaml",
                            [f"{{name: web, kind: image_folder, uri: {folder}}}"])
    home = write_instance_config(tmp_path / "home")
    config = {"ops": {"raw_images": {"config": {"chunk_rows": 4, "files_per_task": 4}}}}
    spec = RunSpec(sources, "source_job", "web", home, data_root, ("raw_images",),
                   run_config=config).arm("ingest.chunk_committed", tmp_path)
    run = RunProcess(spec, tmp_path)
    try:
        held = wait_for_failpoint(run)
        assert held["pid"] == run.process.pid  # the driver, between two commits
    finally:
        run.kill()
    uri = data_root / "lance/raw_images/web.lance"
    committed = lance.dataset(str(uri)).count_rows()
    assert 0 < committed < total  # readable, one chunk in

    instance = open_instance(home)
    try:
        mark_killed_run_failed(instance, spec.run_id)
        job = build_defs(sources).resolve_job_def("source_job").get_subset(
            asset_selection={dg.AssetKey("raw_images")}, asset_check_selection=set())
        rerun = job.execute_in_process(partition_key="web", instance=instance,
                                       run_config=config)
        assert rerun.success
        meta = materialization(rerun)
        assert 0 < meta["rows_processed"] < total
        assert meta["rows_processed"] + meta["rows_reused"] == total == meta["dagster/row_count"]
        resumed = table_state(uri)["rows"]
        shutil.rmtree(uri)
        fresh = job.execute_in_process(partition_key="web", instance=instance, run_config=config)
        assert fresh.success and materialization(fresh)["rows_processed"] == total
        assert table_state(uri)["rows"] == resumed  # same ids, bytes, sha256, everything
    finally:
        instance.dispose()


def test_sources_in_the_bucket_ingest_into_the_bucket_and_rerun_incrementally(
        ray_session, s3_server, s3_root, tmp_path):
    """A webdataset and a parquet source uploaded to the S3 server, the data root in the same
    bucket: both stream from there, and a rerun after one tar is added and one parquet file
    removed reads exactly those."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from prx_assets.storage.layout import Storage

    client = s3_server.client()
    bucket, prefix = s3_root.partition("://")[2].split("/", 1)

    def put(key: str, data: bytes) -> None:
        client.put_object(Bucket=bucket, Key=f"{prefix}/sources/{key}", Body=data)

    def tar_bytes(keys: list[str], seed: int) -> bytes:
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            for i, key in enumerate(keys):
                for name, data in ((f"{key}.jpg", jpeg_bytes(480, 400, seed + i)),
                                   (f"{key}.txt", f"caption {key}".encode())):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        return buffer.getvalue()

    def parquet_bytes(keys: list[str], seed: int) -> bytes:
        buffer = io.BytesIO()
        pq.write_table(pa.table({"k": keys, "img": [jpeg_bytes(480, 400, seed + i)
                                                    for i in range(len(keys))]}), buffer)
        return buffer.getvalue()

    put("wds/a.tar", tar_bytes(["a0", "a1"], 0))
    put("wds/b.tar", tar_bytes(["b0"], 10))
    put("pq/one.parquet", parquet_bytes(["k1", "k2"], 20))
    put("pq/two.parquet", parquet_bytes(["k3"], 30))
    sources = write_sources(tmp_path / "sources.yaml", [
        f"{{name: tars, kind: webdataset, uri: '{s3_root}/sources/wds'}}",
        f"{{name: pq, kind: parquet, uri: '{s3_root}/sources/pq', image_column: img, "
        f"key_column: k}}"])
    instance = dg.DagsterInstance.ephemeral()
    for source, n in (("tars", 3), ("pq", 3)):
        result = run_partition(sources, source, instance)
        assert result.success, result.all_events
        meta = materialization(result)
        assert counts(meta) == (n, 0, 0) and meta["ok_rows"] == n
        assert meta["path"] == f"{s3_root}/lance/raw_images/{source}.lance"
    assert not (tmp_path / "data").exists() and not list(tmp_path.rglob("*.lance"))

    put("wds/c.tar", tar_bytes(["c0"], 40))
    client.delete_object(Bucket=bucket, Key=f"{prefix}/sources/pq/two.parquet")
    tars = materialization(run_partition(sources, "tars", instance))
    pqs = materialization(run_partition(sources, "pq", instance))
    assert counts(tars) == (1, 3, 0) and counts(pqs) == (0, 2, 1)
    table = Storage(s3_root).table("raw_images", "tars").to_table(columns=["source_key", "image"])
    assert sorted(table["source_key"].to_pylist()) == ["a.tar/a0", "a.tar/a1", "b.tar/b0",
                                                       "c.tar/c0"]
    assert sorted(Storage(s3_root).table("raw_images", "pq").to_table(
        columns=["source_key"])["source_key"].to_pylist()) == ["k1", "k2"]


def test_a_source_in_a_missing_bucket_fails_at_once_naming_the_uri(
        ray_session, s3_server, s3_root, tmp_path):
    sources = write_sources(tmp_path / "sources.yaml", [
        "{name: tars, kind: webdataset, uri: 's3://no-such-source-bucket/wds'}"])
    result = run_partition(sources, "tars", dg.DagsterInstance.ephemeral())
    assert not result.success
    message = result.failure_data_for_node("raw_images").error.message
    assert "s3://no-such-source-bucket/wds" in message and "does not exist" in message
