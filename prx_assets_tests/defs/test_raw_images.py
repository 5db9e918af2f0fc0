import io
import subprocess
import sys
import tarfile
from pathlib import Path

import dagster as dg
import lance
import pytest

from prx_assets.definitions import build_defs
from prx_assets_tests.conftest import jpeg_bytes, write_sources


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
    job = build_defs(sources).resolve_job_def("corpus_job")
    return job.execute_in_process(partition_key=partition, instance=instance, raise_on_error=False,
                                  asset_selection=[dg.AssetKey("raw_images")])


def materialization(result, asset: str = "raw_images") -> dict:
    events = [e.event_specific_data.materialization for e in result.get_asset_materialization_events()
              if e.event_specific_data.materialization.asset_key.path[-1] == asset]
    assert len(events) == 1
    return {k: v.value for k, v in events[0].metadata.items()}


def checks(result) -> dict:
    return {f"{e.event_specific_data.asset_key.path[-1]}:{e.event_specific_data.check_name}":
            e.event_specific_data.passed
            for e in result.all_events if e.event_type_value == "ASSET_CHECK_EVALUATION"}


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
    assert not list((data_root / "_work").rglob("*.parquet"))  # manifests removed after writes


def test_missing_source_path_fails_that_partition_clearly(ray_session, data_root, two_sources):
    result = run_partition(two_sources, "gone", dg.DagsterInstance.ephemeral())
    assert not result.success
    failure = result.failure_data_for_node("raw_images")
    assert "source 'gone'" in failure.error.message and "/nonexistent/images" in failure.error.message


def test_code_location_validates_from_the_workspace():
    root = Path(__file__).parents[2]
    dagster = Path(sys.executable).parent / "dagster"
    result = subprocess.run([str(dagster), "definitions", "validate", "-w", "workspace.yaml"],
                            cwd=root, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
