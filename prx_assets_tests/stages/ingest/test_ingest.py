from pathlib import Path

import lance
import pyarrow as pa
import pytest

from prx_assets.stages.ingest.ids import sample_id
from prx_assets.stages.ingest.ingest import IngestOptions, build_raw_dataset, plan_ingest
from prx_assets.stages.ingest.listing import SourceNotFoundError
from prx_assets.stages.ingest.raw_rows import RAW_IMAGES_SCHEMA
from prx_assets.stages.ingest.sources import SourceSpec
from prx_assets.storage.lance_tables import FragmentPolicy, write_dataset_atomically
from prx_assets.storage.refs import TableRef
from prx_assets.testing.images import jpeg_bytes


def ingest(spec: SourceSpec, uri: Path, tmp_path: Path, **options) -> pa.Table:
    out = tmp_path / f"{spec.name}-{len(list(tmp_path.iterdir()))}.lance"
    dataset = build_raw_dataset(spec, uri, options=IngestOptions(**options))
    write_dataset_atomically(dataset, TableRef.of(out), FragmentPolicy(), RAW_IMAGES_SCHEMA)
    return lance.dataset(str(out)).to_table().sort_by("source_key")


def test_image_folder_rows_carry_statuses_and_untouched_bytes(ray_session, small_folder, tmp_path):
    spec = SourceSpec(name="web", kind="image_folder", uri=str(small_folder))
    table = ingest(spec, small_folder, tmp_path, units_per_task=2)
    rows = {r["source_key"]: r for r in table.to_pylist()}
    assert {k: r["status"] for k, r in rows.items()} == {
        "a/b/two.png": "ok", "a/one.jpg": "ok", "three.webp": "ok",
        "anim.png": "unsupported_format", "cut.jpg": "truncated", "dangling.jpg": "unreadable",
        "empty.jpg": "empty_file", "notes.jpg": "not_an_image"}
    one = rows["a/one.jpg"]
    assert one["image"] == (small_folder / "a/one.jpg").read_bytes()
    assert (one["width"], one["height"], one["format"]) == (640, 480, "JPEG")
    assert one["original_caption"] == "first caption" and one["id"] == sample_id("web", "a/one.jpg")
    assert one["n_bytes"] == len(one["image"]) and len(one["sha256"]) == 64
    assert all(r["image"] is None for r in rows.values() if r["status"] != "ok")
    assert all(r["error"] for r in rows.values() if r["status"] != "ok")


def test_ids_are_stable_across_reruns_and_unique(ray_session, small_folder, tmp_path):
    spec = SourceSpec(name="web", kind="image_folder", uri=str(small_folder))
    first = ingest(spec, small_folder, tmp_path).column("id").to_pylist()
    second = ingest(spec, small_folder, tmp_path, units_per_task=1).column("id").to_pylist()
    assert first == second and len(set(first)) == len(first)


def test_decompression_bomb_cap_is_configurable(ray_session, small_folder, tmp_path):
    spec = SourceSpec(name="web", kind="image_folder", uri=str(small_folder))
    table = ingest(spec, small_folder, tmp_path, max_pixels=250_000)
    statuses = dict(zip(table.column("source_key").to_pylist(), table.column("status").to_pylist(),
                        strict=True))
    assert statuses["a/one.jpg"] == "too_many_pixels"  # 640x480 > 250k
    assert statuses["three.webp"] == "ok"  # 300x600 < 250k


def test_lance_source_is_read_by_key(ray_session, tmp_path):
    src = tmp_path / "src.lance"
    lance.write_dataset(pa.table({"key": ["k1", "k2"], "image": [jpeg_bytes(400, 300), b""],
                                  "alt": ["alt one", None]}), src)
    spec = SourceSpec(name="ln", kind="lance", uri=str(src), key_column="key",
                      caption_column="alt")
    table = ingest(spec, src, tmp_path).to_pylist()
    assert [(r["source_key"], r["status"], r["original_caption"]) for r in table] == [
        ("k1", "ok", "alt one"), ("k2", "empty_file", None)]


def test_missing_source_is_a_clear_error(ray_session, tmp_path):
    spec = SourceSpec(name="gone", kind="webdataset", uri="x")
    with pytest.raises(SourceNotFoundError, match="source 'gone'"):
        build_raw_dataset(spec, tmp_path / "missing")


def test_units_reach_ray_in_bounded_blocks_without_a_manifest(ray_session, small_folder):
    import ray

    spec = SourceSpec(name="web", kind="image_folder", uri=str(small_folder))
    plan = plan_ingest(spec, small_folder, done={}, block_units=3)
    blocks = [ray.get(block.ref) for block in plan.blocks]
    assert [b.num_rows for b in blocks] == [3, 3, 2] and plan.pending_units == 8
    assert [unit for b in blocks for unit in b.column("unit").to_pylist()] == list(plan.listed)
    done = dict(list(plan.listed.items())[:5])  # already committed under these signatures
    again = plan_ingest(spec, small_folder, done=done, block_units=3)
    assert again.pending_units == 3 and again.listed == plan.listed
