"""The contact sheet of rejects: a bounded read, one row of thumbnails per reason."""

import io

import lance
import pyarrow as pa
from PIL import Image

from prx_assets.stages.report.contact_sheet import (
    GAP_PX,
    LABEL_PX,
    SHEET_THUMBS,
    THUMB_PX,
    contact_sheet_png,
    reject_samples,
)
from prx_assets.storage.refs import TableRef


def jpeg(width: int, height: int, colour: tuple[int, int, int]) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(out, "JPEG")
    return out.getvalue()


def test_a_row_per_reason_of_at_most_twelve_thumbnails_that_decode():
    samples = {"too_small": [jpeg(40, 30, (200, 0, 0))] * 15 + [b"not an image"],
               "bad_aspect": [b"broken", jpeg(400, 50, (0, 0, 200))],
               "unreadable": [b"broken"]}
    png = contact_sheet_png(samples, {"too_small": 40, "bad_aspect": 2})
    assert png is not None
    sheet = Image.open(io.BytesIO(png))
    cell = THUMB_PX + GAP_PX
    # Two rows: the reason whose images all fail to decode has none.
    assert sheet.size == (LABEL_PX + SHEET_THUMBS * cell, 2 * cell + GAP_PX)
    rgb = sheet.convert("RGB")
    # too_small: twelve red thumbnails, the thirteenth cell empty; bad_aspect: a blue strip.
    red, blue = rgb.getpixel((LABEL_PX + 11 * cell + 20, GAP_PX + 32)), \
        rgb.getpixel((LABEL_PX + THUMB_PX // 2, GAP_PX + cell + 32))
    assert red[0] > 150 and red[2] < 80
    assert blue[2] > 150 and blue[0] < 80
    assert len(png) < 40_000


def test_no_sheet_when_nothing_decodes():
    assert contact_sheet_png({"unreadable": [b"broken"]}) is None
    assert contact_sheet_png({}) is None


def test_only_the_first_rejected_rows_per_reason_are_read(tmp_path):
    statuses = ["ok"] * 5 + ["too_small"] * 20 + ["bad_aspect"] * 3 + ["unreadable"]
    ids = [f"web:{i:03d}" for i in range(len(statuses))]
    lance.write_dataset(pa.table({"id": ids, "status": statuses}), tmp_path / "b.lance")
    lance.write_dataset(pa.table({"id": ids, "image": [jpeg(8, 8, (i, 0, 0))
                                                       for i in range(len(ids))]}),
                        tmp_path / "r.lance")
    bucketed, raw = TableRef.of(tmp_path / "b.lance"), TableRef.of(tmp_path / "r.lance")
    samples = reject_samples(bucketed, raw, per_reason=4)
    assert {reason: len(images) for reason, images in samples.items()} == {
        "too_small": 4, "bad_aspect": 3}
    assert reject_samples(TableRef.of(tmp_path / "missing.lance"), raw) == {}
