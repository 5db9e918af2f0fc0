"""Issue 14's promise across the whole per-source graph: a source that gains one file and
loses one is redone for exactly those two rows at every stage (the contract's metadata says
so), and its tables then equal a fresh full build's (same ids, same bytes)."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest

from prx_assets.definitions import build_defs
from prx_assets.defs.metadata import ROWS_PROCESSED, ROWS_REMOVED, ROWS_REUSED
from prx_assets.storage.layout import Storage
from prx_assets.storage.tables import (
    BUCKETED_IMAGES,
    CAPTION_LABELS,
    CAPTIONS,
    MDS_SAMPLES,
    MDS_SHARDS,
    PHASHES,
    RAW_IMAGES,
)
from prx_assets.testing.images import jpeg_bytes
from prx_assets.testing.sources import write_sources

pytestmark = pytest.mark.e2e  # whole-graph runs and runs in subprocesses

SOURCE = "web"
# Per-source stages and the columns whose values must equal a fresh build's.
COMPARED = {
    RAW_IMAGES: ["id", "sha256", "image", "original_caption", "status"],
    BUCKETED_IMAGES: ["id", "status", "tier", "width", "height", "image"],
    PHASHES: ["id", "phash"],
    CAPTIONS: ["id", "caption_version", "caption", "status"],
    CAPTION_LABELS: ["id", "caption_version", "classifier_version", "label"],
    MDS_SAMPLES: ["id", "tier", "width", "height"],
}
STAGES = (RAW_IMAGES, BUCKETED_IMAGES, PHASHES, CAPTIONS, CAPTION_LABELS, MDS_SHARDS)


def add_picture(folder: Path, i: int) -> None:
    (folder / f"p{i}.jpg").write_bytes(jpeg_bytes(640 + 32 * (i % 4), 512, i))
    (folder / f"p{i}.txt").write_text(f"Soft red and grey gradients, picture number {i}.")


def remove_picture(folder: Path, i: int) -> None:
    (folder / f"p{i}.jpg").unlink()
    (folder / f"p{i}.txt").unlink()


def run_source(sources: Path, captioner: Path, instance: dg.DagsterInstance) -> dict:
    """source_job for the source; the metadata of each asset it materialised."""
    defs = build_defs(sources, captioner)
    result = defs.resolve_job_def("source_job").execute_in_process(
        partition_key=SOURCE, instance=instance, raise_on_error=False)
    assert result.success, [e.message for e in result.all_events if e.is_failure]
    return {e.event_specific_data.materialization.asset_key.path[-1]:
            {k: v.value for k, v in e.event_specific_data.materialization.metadata.items()}
            for e in result.get_asset_materialization_events()}


def table_rows(root: Path, table: str) -> list[dict]:
    rows = Storage(root).table(table, SOURCE).to_table(columns=COMPARED[table]).to_pylist()
    return sorted(rows, key=lambda row: (row["id"], repr(row)))


@pytest.mark.timeout(1800)
def test_one_file_gained_and_one_lost_is_two_rows_of_work_at_every_stage(
        ray_session, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    folder = tmp_path / "pictures"
    folder.mkdir()
    for i in range(6):
        add_picture(folder, i)
    sources = write_sources(tmp_path / "sources.yaml",
                            [f"{{name: {SOURCE}, kind: image_folder, uri: {folder}}}"])
    captioner = tmp_path / "captioner.yaml"  # absent: the default (source captions)
    incremental_root = tmp_path / "incremental"
    monkeypatch.setenv("PRX_DATA_ROOT", str(incremental_root))

    with dg.instance_for_test() as instance:
        first = run_source(sources, captioner, instance)
        assert first[RAW_IMAGES][ROWS_PROCESSED] == 6
        unchanged = run_source(sources, captioner, instance)
        for stage in STAGES:
            assert unchanged[stage][ROWS_PROCESSED] == 0, (stage, unchanged[stage])
            assert unchanged[stage][ROWS_REMOVED] == 0, (stage, unchanged[stage])

        add_picture(folder, 6)
        remove_picture(folder, 0)
        rerun = run_source(sources, captioner, instance)

    for stage in STAGES:
        counts = {key: rerun[stage][key] for key in (ROWS_PROCESSED, ROWS_REUSED, ROWS_REMOVED)}
        assert counts == {ROWS_PROCESSED: 1, ROWS_REUSED: 5, ROWS_REMOVED: 1}, (stage, counts)

    fresh_root = tmp_path / "fresh"
    monkeypatch.setenv("PRX_DATA_ROOT", str(fresh_root))
    with dg.instance_for_test() as instance:
        run_source(sources, captioner, instance)
    for table in COMPARED:
        assert table_rows(incremental_root, table) == table_rows(fresh_root, table), table
