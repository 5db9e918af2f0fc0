"""Per-source input tables of the corpus (bucketed_images, phashes, captions, caption_labels)
written directly, so corpus and search tests need no image or caption stage run."""

from __future__ import annotations

from pathlib import Path

import lance
import numpy as np
import pyarrow as pa

from prx_assets.core.corpus import SourceTables
from prx_assets.core.embeddings import MiniLMEmbedder
from prx_assets.core.image_stage import BUCKETED_SCHEMA, PHASH_COLUMNS, PHASH_SCHEMA
from prx_assets.core.labels import LABELS, active_labels_filter, label_rows
from prx_assets_tests.conftest import jpeg_bytes
from prx_assets_tests.labelled_captions import write_captions

CAPTION_VERSION = "v1"
CLASSIFIER_VERSION = "test-classifier"


def write_source(root: Path, source: str, rows: list[tuple[str, str, str]],
                 embedder: MiniLMEmbedder | None, extra_kept: int = 0) -> SourceTables:
    """(key, caption, label) rows become kept 640x480 images with captions and labels;
    `extra_kept` kept images get no caption; one rejected image is added too. Without an
    embedder no caption_labels table is written (the asset under test makes it)."""
    tables = SourceTables(
        source, root / f"bucketed_images/{source}.lance", root / f"captions/{source}.lance",
        root / f"caption_labels/{source}.lance", root / f"phashes/{source}.lance",
        f"caption_version = '{CAPTION_VERSION}' AND status = 'ok'",
        active_labels_filter(CAPTION_VERSION, CLASSIFIER_VERSION))
    ids = [f"{source}:{key}" for key, _, _ in rows]
    image = jpeg_bytes(640, 480, 7)
    kept = [{"id": i, "source": source, "status": "ok", "tier": 512, "width": 576,
             "height": 448, "original_width": 640, "original_height": 480, "image": image,
             "error": None, "phash": n, "pixels": 640 * 480, "flat": False}
            for n, i in enumerate(ids + [f"{source}:nocaption{j}" for j in range(extra_kept)])]
    rejected = {"id": f"{source}:tiny", "source": source, "status": "too_small",
                "error": "below 384x384"}
    bucketed = pa.Table.from_pylist(kept + [rejected], schema=BUCKETED_SCHEMA)
    for uri, table in ((tables.bucketed, bucketed),
                       (tables.phashes, bucketed.select(PHASH_COLUMNS).slice(0, len(kept))
                        .cast(PHASH_SCHEMA))):
        uri.parent.mkdir(parents=True, exist_ok=True)
        lance.write_dataset(table, str(uri), mode="overwrite")
    write_captions(tables.captions, [(i, c) for i, (_, c, _) in zip(ids, rows)], CAPTION_VERSION)
    if embedder is None:
        return tables
    vectors = embedder.embed([c for _, c, _ in rows])
    scores = np.eye(len(LABELS), dtype=np.float32)[[LABELS.index(l) for _, _, l in rows]]
    labels = label_rows(ids, [CAPTION_VERSION] * len(ids), CLASSIFIER_VERSION,
                        [l for _, _, l in rows], scores, vectors)
    tables.labels.parent.mkdir(parents=True, exist_ok=True)
    lance.write_dataset(labels, str(tables.labels), mode="overwrite")
    return tables
