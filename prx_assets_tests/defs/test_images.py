import base64
import io
import shutil

import dagster as dg
import lance
import numpy as np
from PIL import Image

from prx_assets.definitions import build_defs
from prx_assets.demo.corpus import encode, photo_variant, real_photo_paths
from prx_assets.stages.images import pil_backend
from prx_assets.stages.images.phash import hash_hex
from prx_assets.stages.ingest.ids import sample_id
from prx_assets.stages.report.contact_sheet import GAP_PX, THUMB_PX
from prx_assets.testing import stock_pillow
from prx_assets.testing.dagster_results import checks
from prx_assets.testing.images import jpeg_bytes
from prx_assets.testing.sources import write_sources


def test_image_stage_decodes_once_into_two_tables_with_checks(ray_session, data_root, tmp_path):
    folder = tmp_path / "imgs"
    folder.mkdir()
    rng = np.random.default_rng(0)
    photos = [Image.open(p) for p in real_photo_paths()][:6]
    for i, photo in enumerate(photos):
        (folder / f"photo{i}.jpg").write_bytes(encode(photo_variant(rng, photo), "JPEG", 90))
    (folder / "big.jpg").write_bytes(jpeg_bytes(1600, 1200, 1))
    (folder / "small.jpg").write_bytes(jpeg_bytes(200, 200, 2))
    (folder / "wide.jpg").write_bytes(jpeg_bytes(1500, 400, 3))
    good = jpeg_bytes(900, 700, 4)
    (folder / "broken.jpg").write_bytes(good[:300] + b"\x00" * 2000 + good[-200:])  # bad middle
    (folder / "flat.png").write_bytes(_png(Image.new("RGB", (700, 700), (40, 40, 40))))
    (folder / "notes.jpg").write_bytes(b"text")
    sources = write_sources(tmp_path / "s.yaml",
                            [f"{{name: web, kind: image_folder, uri: {folder}}}"])

    instance = dg.DagsterInstance.ephemeral()
    result = build_defs(sources).resolve_job_def("source_job").execute_in_process(
        partition_key="web", instance=instance,
        asset_selection=[dg.AssetKey(k) for k in ("raw_images", "bucketed_images", "phashes")])
    assert result.success

    bucketed = lance.dataset(str(data_root / "lance/bucketed_images/web.lance")).to_table()
    rows = {r["id"]: r for r in bucketed.to_pylist()}
    raw = lance.dataset(str(data_root / "lance/raw_images/web.lance")).to_table().to_pylist()
    assert set(rows) == {r["id"] for r in raw}  # one bucketed row per raw row
    by_key = {r["source_key"]: rows[r["id"]] for r in raw}
    assert by_key["small.jpg"]["status"] == "too_small"
    assert by_key["wide.jpg"]["status"] == "bad_aspect"
    # Its Huffman tables are cut: Pillow 12's JPEG parser (pillow-simd's base) rejects it on
    # open, at ingest; Pillow 13 opens it and the image stage's decode fails.
    pillow_major = int(Image.__version__.split(".")[0])
    assert by_key["broken.jpg"]["status"] == ("not_an_image" if pillow_major < 13
                                              else "undecodable")
    assert by_key["notes.jpg"]["status"] == "not_an_image"  # passed through from ingest
    big = by_key["big.jpg"]
    assert (big["status"], big["tier"], big["original_width"]) == ("ok", 1024, 1600)
    assert Image.open(io.BytesIO(big["image"])).size == (big["width"], big["height"])

    hashes = {r["id"]: r for r in lance.dataset(
        str(data_root / "lance/phashes/web.lance")).to_table().to_pylist()}
    assert set(hashes) == {i for i, r in rows.items() if r["status"] == "ok"}
    originals = {r["id"]: r["image"] for r in raw}
    ids = sorted(hashes)
    reference = dict(zip(ids, stock_pillow.stock([originals[i] for i in ids])["phash"],
                         strict=True))
    for image_id, h in hashes.items():
        assert hash_hex(h["phash"]) == reference[image_id]  # stock imagehash.phash
        row = rows[image_id]
        assert h["pixels"] == row["original_width"] * row["original_height"]
    assert [h["flat"] for h in hashes.values()].count(True) == 1

    outcome = checks(result)
    assert outcome["bucketed_images:jpeg_fidelity"] is True
    assert all(outcome[f"{t}:{c}"] for t in ("bucketed_images", "phashes")
               for c in ("ids_unique", "fragments_healthy"))
    mats = {e.event_specific_data.materialization.asset_key.path[-1]:
            e.event_specific_data.materialization.metadata
            for e in result.get_asset_materialization_events()}
    meta = mats["bucketed_images"]
    assert meta["kept"].value == len(hashes)
    assert sum(r.data["count"] for r in meta["images_per_shape"].value.records) == len(hashes)
    # The same counts as a tier × shape matrix (Markdown), its totals summing to the kept.
    matrix = meta["tier_by_shape"].value.splitlines()
    assert matrix[0].startswith("| tier | w/h ")
    assert sum(int(row.rsplit("|", 2)[1]) for row in matrix[2:]) == len(hashes)
    assert meta["kept_share_in_words"].value.endswith(f"({len(hashes):,} of "
                                                      f"{meta['dagster/row_count'].value:,})")
    assert meta["input_version/raw_images"].value == mats["raw_images"]["lance_version"].value
    assert meta["image_backend"].value == pil_backend.current().name
    assert meta["image_backend_version"].value == Image.__version__
    assert mats["phashes"]["flat_images"].value == 1
    # What was thrown away, as pictures: small.jpg (too_small) and wide.jpg (bad_aspect).
    sheet = meta["rejects_contact_sheet"].value
    assert sheet.startswith("![rejected images per reason](data:image/png;base64,")
    rows = Image.open(io.BytesIO(base64.b64decode(sheet.split(",", 1)[1][:-1]))).height
    assert rows == 2 * (THUMB_PX + GAP_PX) + GAP_PX
    assert meta["stage_seconds"].value > 0
    assert meta["stage_seconds_in_words"].value.endswith(("s", "min"))
    # No GPU: the cost is one CPU machine's time per 1,000 images at the configured price.
    assert "on 1 CPU machine" in meta["cost_per_1000_images"].value
    assert meta["cost_per_1000_images_usd"].value > 0


def _png(img: Image.Image) -> bytes:
    buffer = io.BytesIO()
    img.save(buffer, "PNG")
    return buffer.getvalue()


# ------------------------------------------------------------------ incremental runs

IMAGE_ASSETS = ("bucketed_images", "phashes")


def _stage_run(defs, instance, assets=("raw_images", *IMAGE_ASSETS), run_config=None) -> dict:
    """Materialise `assets` of partition "web" (checks left out); metadata per asset."""
    from prx_assets.testing.fault_runs import run_in_process

    result = run_in_process(defs, "source_job", "web", instance, assets, run_config)
    assert result.success
    return {e.event_specific_data.materialization.asset_key.path[-1]: e.event_specific_data
            for e in result.get_asset_materialization_events()}


def _counts(event) -> tuple[int, int, int]:
    meta = event.materialization.metadata
    return tuple(meta[k].value for k in ("rows_processed", "rows_reused", "rows_removed"))


def _data_version(event) -> str:
    return event.materialization.tags["dagster/data_version"]


def _rows(uri) -> dict:
    """Every row of a table by id; the image bytes compared as they are."""
    rows = lance.dataset(str(uri)).to_table().to_pylist()
    assert len({r["id"] for r in rows}) == len(rows), "duplicate ids"
    return {r["id"]: r for r in rows}


def _image_folder(tmp_path, n: int):
    folder = tmp_path / "imgs"
    folder.mkdir()
    for i in range(n):
        (folder / f"p{i:02d}.jpg").write_bytes(jpeg_bytes(480 + 16 * i, 400, i))
    (folder / "small.jpg").write_bytes(jpeg_bytes(200, 200, 99))  # rejected, no phash
    return folder


def _folder_source(tmp_path, n: int):
    """A folder of `n` images as source `web`, its definitions and an ephemeral instance."""
    folder = _image_folder(tmp_path, n)
    sources = write_sources(tmp_path / "s.yaml",
                            [f"{{name: web, kind: image_folder, uri: {folder}}}"])
    return folder, build_defs(sources), dg.DagsterInstance.ephemeral()


def test_image_stage_redoes_only_changed_rows(ray_session, data_root, tmp_path):
    folder, defs, instance = _folder_source(tmp_path, 6)
    first = _stage_run(defs, instance)
    assert _counts(first["bucketed_images"]) == (7, 0, 0)
    assert _counts(first["phashes"]) == (6, 0, 0)
    assert first["bucketed_images"].materialization.metadata["ray_nodes"].value == 1

    # Nothing changed: nothing redone, both data versions kept (downstream stays fresh).
    again = _stage_run(defs, instance)
    for name in IMAGE_ASSETS:
        assert _counts(again[name])[0::2] == (0, 0)
        assert _data_version(again[name]) == _data_version(first[name])
    assert again["bucketed_images"].materialization.metadata["lance_version"].value == \
        first["bucketed_images"].materialization.metadata["lance_version"].value

    # One file gained, one lost: exactly those two rows change.
    (folder / "p99.jpg").write_bytes(jpeg_bytes(640, 480, 1234))
    (folder / "p03.jpg").unlink()
    changed = _stage_run(defs, instance)
    assert _counts(changed["bucketed_images"]) == (1, 6, 1)
    assert _counts(changed["phashes"]) == (1, 5, 1)
    for name in IMAGE_ASSETS:
        assert _data_version(changed[name]) != _data_version(first[name])
    meta = changed["bucketed_images"].materialization.metadata
    assert meta["input_version/raw_images"].value == \
        changed["raw_images"].materialization.metadata["lance_version"].value
    incremental = {name: _rows(data_root / f"lance/{name}/web.lance") for name in IMAGE_ASSETS}
    assert set(incremental["bucketed_images"]) == {
        sample_id("web", p.name) for p in folder.iterdir()}

    # A full rebuild from the same raw_images: same ids, same bytes, in both tables.
    for name in IMAGE_ASSETS:
        shutil.rmtree(data_root / f"lance/{name}/web.lance")
    rebuilt = _stage_run(defs, instance, IMAGE_ASSETS)
    assert _counts(rebuilt["bucketed_images"]) == (7, 0, 0)
    for name in IMAGE_ASSETS:
        assert _rows(data_root / f"lance/{name}/web.lance") == incremental[name]

    # A settings change redoes every row (and records the new fingerprint on each).
    config = {"ops": {"image_stage": {"config": {"jpeg_quality": 90, "chunk_rows": 3}}}}
    requality = _stage_run(defs, instance, IMAGE_ASSETS, config)
    assert _counts(requality["bucketed_images"]) == (7, 0, 0)
    assert requality["bucketed_images"].materialization.metadata["chunks_committed"].value == 3
    settings = requality["bucketed_images"].materialization.metadata["settings"].value
    after = _rows(data_root / "lance/bucketed_images/web.lance")
    assert {r["settings"] for r in after.values()} == {settings}
    assert set(after) == set(incremental["bucketed_images"])
    kept = [i for i, r in after.items() if r["status"] == "ok"]
    assert all(after[i]["image"] != incremental["bucketed_images"][i]["image"] for i in kept)


def test_image_stage_incremental_in_a_bucket(ray_session, s3_server, s3_root, tmp_path):
    """The same per-row rerun with PRX_DATA_ROOT=s3://: every table read and commit goes
    through the storage options."""
    from prx_assets.storage.layout import Storage

    folder, defs, instance = _folder_source(tmp_path, 3)
    first = _stage_run(defs, instance)
    assert _counts(first["bucketed_images"]) == (4, 0, 0)
    (folder / "p99.jpg").write_bytes(jpeg_bytes(640, 480, 1234))
    (folder / "p01.jpg").unlink()
    changed = _stage_run(defs, instance)
    assert _counts(changed["bucketed_images"]) == (1, 3, 1)
    assert _counts(changed["phashes"]) == (1, 2, 1)
    meta = changed["bucketed_images"].materialization.metadata
    assert meta["path"].value == f"{s3_root}/lance/bucketed_images/web.lance"
    ids = Storage(s3_root).table("bucketed_images", "web").to_table(columns=["id"])
    assert sorted(ids.column("id").to_pylist()) == sorted(
        sample_id("web", p.name) for p in folder.iterdir())
    assert not (tmp_path / "data").exists()
