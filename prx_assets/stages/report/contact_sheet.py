"""A contact sheet of what the image stage threw away: one row per reject reason, up to
SHEET_THUMBS thumbnails of rejected images that decode, as one small PNG.

Bounded: per reason, the ids of the first SHEET_THUMBS rejected rows (a Lance filter with a
limit) and then only those rows' raw bytes; never the whole table. An image that does not
decode is left out (its row says how many were shown).
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence

from PIL import Image, ImageDraw

from prx_assets.stages.images.buckets import STATUS_BAD_ASPECT, STATUS_TOO_SMALL
from prx_assets.storage.filters import eq_filter, in_filter
from prx_assets.storage.refs import TableRef

SHEET_THUMBS = 12
THUMB_PX = 64
GAP_PX = 4
LABEL_PX = 150  # the reason's column on the left
# Rejected for their size or shape: they decode. Other reasons are files that did not.
DECODED_REJECTS = (STATUS_TOO_SMALL, STATUS_BAD_ASPECT)
BACKGROUND = (245, 245, 245)
TEXT = (40, 40, 40)


def reject_samples(bucketed: TableRef, raw: TableRef, reasons: Sequence[str] = DECODED_REJECTS,
                   per_reason: int = SHEET_THUMBS) -> dict[str, list[bytes]]:
    """The raw bytes of up to `per_reason` rejected images per reason (reasons with none
    are left out)."""
    samples: dict[str, list[bytes]] = {}
    if not (bucketed.exists() and raw.exists()):
        return samples
    for reason in reasons:
        ids = bucketed.to_table(columns=["id"], filter=eq_filter("status", reason),
                                limit=per_reason).column("id").to_pylist()
        if not ids:
            continue
        images = raw.to_table(columns=["image"], filter=in_filter("id", ids),
                              limit=per_reason).column("image").to_pylist()
        samples[reason] = [data for data in images if data]
    return samples


def thumbnail(data: bytes, px: int = THUMB_PX) -> Image.Image | None:
    """An RGB thumbnail at most `px` on its longest side; None when the bytes do not decode."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            img.draft("RGB", (px, px))  # JPEG: decode at a reduced scale
            img.thumbnail((px, px))
            return img.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError):
        return None


def contact_sheet_png(samples: Mapping[str, Sequence[bytes]],
                      counts: Mapping[str, int] | None = None,
                      per_row: int = SHEET_THUMBS) -> bytes | None:
    """One row per reason: "reason · shown of total" and its thumbnails. None when no image
    decodes. A 256-colour palette PNG keeps the sheet small (~50 KB for 24 photos)."""
    rows = []
    for reason, images in samples.items():
        thumbs = [t for t in (thumbnail(data) for data in images[:per_row]) if t is not None]
        if thumbs:
            rows.append((reason, thumbs))
    if not rows:
        return None
    cell = THUMB_PX + GAP_PX
    sheet = Image.new("RGB", (LABEL_PX + per_row * cell, len(rows) * cell + GAP_PX), BACKGROUND)
    draw = ImageDraw.Draw(sheet)
    for i, (reason, thumbs) in enumerate(rows):
        top = GAP_PX + i * cell
        total = (counts or {}).get(reason, len(samples[reason]))
        draw.text((GAP_PX, top + 4), reason, fill=TEXT)
        draw.text((GAP_PX, top + 20), f"{len(thumbs)} of {total:,} shown", fill=TEXT)
        for j, thumb in enumerate(thumbs):
            # Centred in its cell, so wide and tall images line up.
            x = LABEL_PX + j * cell + (THUMB_PX - thumb.width) // 2
            sheet.paste(thumb, (x, top + (THUMB_PX - thumb.height) // 2))
    out = io.BytesIO()
    sheet.quantize(256).save(out, "PNG", optimize=True)
    return out.getvalue()
