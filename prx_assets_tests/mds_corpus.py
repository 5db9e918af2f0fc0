"""Small bucketed_images + captions tables for the MDS writer and loader tests.

Real Q92 JPEGs (generated photo-like images) of a few shapes; some rows rejected, some
without a usable caption, an older caption version beside the active one.
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

import lance
import numpy as np
import pyarrow as pa

from prx_assets.core.image_stage import BUCKETED_SCHEMA
from prx_assets.core.imaging import encode_jpeg
from prx_assets.core.lance_tables import table_uri
from prx_assets.demo import procedural_image

ACTIVE = "original-v1"
# The captions contract (issue 4); used to build test tables until tests can import it.
CAPTIONS_SCHEMA = pa.schema([
    pa.field("id", pa.string()), pa.field("caption_version", pa.string()),
    pa.field("caption", pa.string()), pa.field("n_words", pa.int32()),
    pa.field("model", pa.string()), pa.field("backend", pa.string()),
    pa.field("status", pa.string()), pa.field("error", pa.string()),
    pa.field("created_at", pa.timestamp("us", tz="UTC")),
])
# Small shapes of two "tiers": tests need several leaves, not large images.
SHAPES = ((1, 64, 64), (1, 48, 80), (1, 80, 48), (2, 96, 96))


def caption_filter(version: str = ACTIVE) -> str:
    return f"caption_version = '{version}' AND status = 'ok'"


def build_corpus(data_root: Path, source: str, per_shape: int = 12, seed: int = 0,
                 shapes=SHAPES, rejected: int = 2, uncaptioned: int = 2) -> dict:
    """Write bucketed_images and captions tables for `source`; returns what a test checks."""
    rng = np.random.default_rng(seed)
    rows, caption_rows, images = [], [], {}
    now = datetime(2026, 1, 1, tzinfo=timezone.utc)
    for tier, w, h in shapes:
        for i in range(per_shape):
            sample_id = f"{source}:{tier}-{w}x{h}-{i:04d}"
            data = encode_jpeg(procedural_image(rng, w, h))
            images[sample_id] = data
            rows.append(_bucketed(sample_id, source, "ok", tier, w, h, data))
    for i in range(rejected):
        rows.append(_bucketed(f"{source}:rejected-{i}", source, "too_small", None, None, None, None))
    ok_ids = sorted(images)
    no_caption = set(ok_ids[::max(1, len(ok_ids) // max(1, uncaptioned))][:uncaptioned])
    for sample_id in ok_ids:
        caption_rows.append(_caption(sample_id, "old-v0", "an older caption", "ok", now))
        status = "refused" if sample_id in no_caption else "ok"
        caption_rows.append(_caption(sample_id, ACTIVE, f"a picture {sample_id}", status, now))
    rng.shuffle(rows)  # table order must not matter
    _write(pa.Table.from_pylist(rows, schema=BUCKETED_SCHEMA),
           table_uri(data_root, "bucketed_images", source))
    _write(pa.Table.from_pylist(caption_rows, schema=CAPTIONS_SCHEMA),
           table_uri(data_root, "captions", source))
    for sample_id in no_caption:
        images.pop(sample_id)
    return {"images": images, "no_caption": no_caption, "rejected": rejected}


def _bucketed(sample_id, source, status, tier, w, h, data) -> dict:
    return {"id": sample_id, "source": source, "status": status, "tier": tier, "width": w,
            "height": h, "original_width": (w or 100) * 3, "original_height": (h or 100) * 3,
            "image": data, "error": None if status == "ok" else status}


def _caption(sample_id, version, text, status, now) -> dict:
    return {"id": sample_id, "caption_version": version, "caption": text,
            "n_words": len(text.split()), "model": "source", "backend": "original",
            "status": status, "error": None, "created_at": now}


def _write(table: pa.Table, uri: Path) -> None:
    uri.parent.mkdir(parents=True, exist_ok=True)
    mode = "overwrite" if uri.exists() else "create"
    lance.write_dataset(table, str(uri), mode=mode, max_rows_per_file=40)  # a few fragments


def inputs_for(data_root: Path, source: str, version: str = ACTIVE):
    from prx_assets.core.mds import SampleInputs

    return SampleInputs(bucketed_uri=str(table_uri(data_root, "bucketed_images", source)),
                        captions_uri=str(table_uri(data_root, "captions", source)),
                        caption_filter=caption_filter(version))
