"""Inputs that cannot hurt (issue 30): each bad input sits in a source beside good files;
it gets a row reason (or a per-file reason naming the column and the fix) and the good
rows go through. Each case failed on the code before the fix (noted per test)."""

from __future__ import annotations

import os
import tarfile
from pathlib import Path

import lance
import pyarrow as pa
import pyarrow.parquet as pq

from prx_assets.stages.ingest import listing
from prx_assets.stages.ingest.ingest import IngestOptions, expand_units
from prx_assets.stages.ingest.raw_rows import FoundItem, raw_row
from prx_assets.stages.ingest.sources import SourceSpec
from prx_assets.testing.images import jpeg_bytes
from prx_assets.testing.tars import add_member


def spec(kind: str, uri: Path, **kwargs) -> SourceSpec:
    return SourceSpec(name="src", kind=kind, uri=str(uri), **kwargs)


def rows_of(s: SourceSpec, root: Path, options: IngestOptions | None = None) -> list[dict]:
    """Every raw row of the source, as the ingest's Ray stage builds them (in-process)."""
    units = list(listing.list_units(s, root)) if s.kind != "lance" else [
        unit for unit, _ in listing.lance_unit_entries(s, listing.source_location(root))]
    signatures = ([sig for _, sig in listing.lance_unit_entries(s, listing.source_location(root))]
                  if s.kind == "lance" else [None] * len(units))
    block = pa.table({"unit": units, "unit_signature": pa.array(signatures, pa.string())})
    tables = expand_units(block, s, str(root), options or IngestOptions())
    return [row for table in tables for row in table.to_pylist()]


def test_an_integer_image_column_is_a_file_reason_not_zero_bytes_or_memory_error(
        ray_session, tmp_path):
    """Before: the value 5 became 5 zero bytes, and 1<<40 raised MemoryError out of the
    partition, good files included."""
    img = jpeg_bytes(400, 400)
    pq.write_table(pa.table({"k": ["a"], "image": [img]}), tmp_path / "good.parquet")
    pq.write_table(pa.table({"k": ["b", "c"], "image": pa.array([5, 1 << 40], pa.int64())}),
                   tmp_path / "ints.parquet")
    rows = rows_of(spec("parquet", tmp_path, key_column="k"), tmp_path)
    by_key = {r["source_key"]: r for r in rows}
    assert by_key["a"]["status"] == "ok" and by_key["a"]["image"] == img
    bad = by_key["ints.parquet#file"]
    assert bad["status"] == "bad_schema"
    assert "'image'" in bad["error"] and "int64" in bad["error"] and "binary" in bad["error"]
    assert not any(r["n_bytes"] for r in rows if r["source_key"] != "a")


def test_an_integer_image_column_in_a_lance_source_is_a_reason(ray_session, tmp_path):
    uri = tmp_path / "t.lance"
    lance.write_dataset(pa.table({"k": ["b"], "image": pa.array([1 << 40], pa.int64())}), uri)
    rows = rows_of(spec("lance", uri, key_column="k"), uri)
    assert [r["status"] for r in rows] == ["bad_schema"]
    assert "'image'" in rows[0]["error"] and rows[0]["n_bytes"] is None


def test_null_and_duplicate_keys_get_row_reasons(ray_session, tmp_path):
    """Before: three rows with a null key became one row keyed "None" (two silently
    dropped), and a repeated key kept its first row with no word about the others."""
    img = jpeg_bytes(400, 400)
    pq.write_table(pa.table({"k": ["a", None, None, None, "b", "a"],
                             "image": [img] * 6}), tmp_path / "p.parquet")
    rows = rows_of(spec("parquet", tmp_path, key_column="k"), tmp_path)
    assert len(rows) == 6 and "None" not in {r["source_key"] for r in rows}
    statuses = sorted(r["status"] for r in rows)
    assert statuses == ["duplicate_key", "null_key", "null_key", "null_key", "ok", "ok"]
    null = next(r for r in rows if r["status"] == "null_key")
    assert "'k'" in null["error"] and null["image"] is None
    duplicate = next(r for r in rows if r["status"] == "duplicate_key")
    assert "'a'" in duplicate["error"] and "row 0" in duplicate["error"]


def test_captions_over_the_cap_are_truncated_with_a_reason(tmp_path):
    """Before: a 16 MiB caption was stored whole."""
    img = jpeg_bytes(400, 400)
    huge = "é" * (8 << 20)  # 16 MiB of UTF-8
    row = raw_row("src", FoundItem(key="a", data=img, caption=huge))
    assert row["status"] == "ok"
    assert len(row["original_caption"].encode()) <= 16 << 10
    assert row["original_caption"] == huge[:len(row["original_caption"])]
    assert "caption truncated" in row["error"] and "16,384" in row["error"]
    small = raw_row("src", FoundItem(key="b", data=img, caption="a cat"))
    assert small["original_caption"] == "a cat" and small["error"] is None
    capped = raw_row("src", FoundItem(key="c", data=img, caption="x" * 100),
                     max_caption_bytes=10)
    assert capped["original_caption"] == "x" * 10


def test_a_symlink_leaving_the_source_root_is_not_ingested(ray_session, tmp_path):
    """Before: the link's target (outside the source) was read and its bytes stored."""
    secret = tmp_path / "outside" / "secret.jpg"
    secret.parent.mkdir()
    secret.write_bytes(jpeg_bytes(400, 400, seed=3))
    (tmp_path / "outside" / "secret.txt").write_text("private words")
    root = tmp_path / "src"
    root.mkdir()
    (root / "good.jpg").write_bytes(jpeg_bytes(400, 400))
    (root / "inside.jpg").symlink_to(root / "good.jpg")  # stays inside: fine
    os.symlink(secret, root / "leak.jpg")
    os.symlink(tmp_path / "outside" / "secret.txt", root / "good.txt")  # a caption leak
    rows = {r["source_key"]: r for r in rows_of(spec("image_folder", root), root)}
    assert rows["good.jpg"]["status"] == "ok" and rows["inside.jpg"]["status"] == "ok"
    assert rows["good.jpg"]["original_caption"] is None
    leak = rows["leak.jpg"]
    assert leak["status"] == "unsafe_path" and leak["image"] is None
    assert leak["sha256"] is None and "outside the source" in leak["error"]


def test_a_truncated_tar_or_parquet_file_is_a_file_reason_and_the_rest_goes_through(
        ray_session, tmp_path):
    img = jpeg_bytes(400, 400)
    tars = tmp_path / "tars"
    tars.mkdir()
    for name in ("a.tar", "b.tar"):
        with tarfile.open(tars / name, "w") as tar:
            for key in ("x", "y", "z"):
                add_member(tar, f"{key}.jpg", img)
    with tarfile.open(tars / "b.tar") as tar:  # cut y mid-data, whatever the JPEG's size
        cut_at = tar.getmember("y.jpg").offset_data + len(img) // 2
    (tars / "b.tar").write_bytes((tars / "b.tar").read_bytes()[:cut_at])
    rows = rows_of(spec("webdataset", tars), tars)
    ok = sorted(r["source_key"] for r in rows if r["status"] == "ok")
    assert ok == ["a.tar/x", "a.tar/y", "a.tar/z", "b.tar/x"]
    assert any(r["source_key"] == "b.tar#tar" and r["status"] == "unreadable" for r in rows)

    parquets = tmp_path / "parquets"
    parquets.mkdir()
    pq.write_table(pa.table({"image": [img, img]}), parquets / "a.parquet")
    pq.write_table(pa.table({"image": [img, img]}), parquets / "b.parquet")
    whole = (parquets / "b.parquet").read_bytes()
    (parquets / "b.parquet").write_bytes(whole[: len(whole) // 2])
    rows = rows_of(spec("parquet", parquets), parquets)
    assert sorted(r["source_key"] for r in rows if r["status"] == "ok") == [
        "a.parquet#0", "a.parquet#1"]
    cut = next(r for r in rows if r["source_key"] == "b.parquet#file")
    assert cut["status"] == "unreadable" and "b.parquet" in cut["error"]
