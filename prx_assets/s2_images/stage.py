"""The image stage over a partition: raw_images rows in, bucketed rows (with phash) out,
as a Ray Data map over bounded batches. Rows rejected at ingest pass their status through,
so every raw row has exactly one bucketed row."""

from __future__ import annotations

import functools

import pyarrow as pa
import ray.data

from prx_assets.engine.failpoints import failpoint
from prx_assets.s2_images.imaging import ImageOptions, process_image
from prx_assets.storage.lance_tables import tag_with_node

BUCKETED_SCHEMA = pa.schema([
    pa.field("id", pa.string(), nullable=False),
    pa.field("source", pa.string(), nullable=False),
    pa.field("status", pa.string(), nullable=False),
    pa.field("tier", pa.int32()),
    pa.field("width", pa.int32()),
    pa.field("height", pa.int32()),
    pa.field("original_width", pa.int32()),
    pa.field("original_height", pa.int32()),
    pa.field("image", pa.large_binary()),
    pa.field("error", pa.string()),
    # The hash columns ride along from the same decode; `phashes` projects them.
    pa.field("phash", pa.int64()),
    pa.field("pixels", pa.int64()),
    pa.field("flat", pa.bool_()),
])

PHASH_COLUMNS = ["id", "phash", "pixels", "flat"]
PHASH_SCHEMA = pa.schema([BUCKETED_SCHEMA.field(name) for name in PHASH_COLUMNS])
RAW_COLUMNS = ["id", "source", "status", "image", "error", "width", "height"]
BATCH_ROWS = 8  # decoded images are large: keep each task's working set small


def bucket_batch(batch: pa.Table, options: ImageOptions) -> pa.Table:
    rows = []
    for raw in batch.to_pylist():
        row = {"id": raw["id"], "source": raw["source"], "status": raw["status"],
               "error": raw["error"], "original_width": raw["width"],
               "original_height": raw["height"]}
        if raw["status"] == "ok":
            result = process_image(raw["image"], options)
            row.update(status=result.status, error=result.error, tier=result.tier,
                       width=result.width, height=result.height, image=result.image,
                       phash=result.phash, flat=result.flat)
            if result.original_width is not None:
                row.update(original_width=result.original_width,
                           original_height=result.original_height)
            if result.phash is not None:
                row["pixels"] = row["original_width"] * row["original_height"]
        rows.append(row)
    failpoint("images.bucket_batch")
    return tag_with_node(pa.Table.from_pylist(rows, schema=BUCKETED_SCHEMA))


def build_bucketed_dataset(raw: ray.data.Dataset, options: ImageOptions = ImageOptions()
                           ) -> ray.data.Dataset:
    # Small blocks before the map: a table may be one large fragment, and one read task
    # must not mean one decoding task.
    return raw.repartition(target_num_rows_per_block=BATCH_ROWS * 4).map_batches(
        functools.partial(bucket_batch, options=options),
        batch_format="pyarrow", batch_size=BATCH_ROWS,
    )
