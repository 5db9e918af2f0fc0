"""Reads of Lance tables: batches sized by bytes for blobs, read tasks without a CPU slot."""

from pathlib import Path

import lance
import numpy as np
import pyarrow as pa

from prx_assets.engine.ray_runtime import MAX_BLOCK_BYTES, configure_ray_data
from prx_assets.storage.reads import (
    READ_BATCH_BYTES,
    READ_TASK_CPUS,
    blob_scanner_options,
    read_concurrency,
    read_table,
)
from prx_assets.storage.refs import TableRef


def test_reads_of_blob_columns_come_in_batches_sized_by_bytes(ray_session, tmp_path: Path):
    # 64 rows of 1 MB images: Lance's default batch (8,192 rows) would be the whole table in
    # one block; a read of the images comes in ~READ_BATCH_BYTES blocks, ids in one.
    uri = TableRef.of(tmp_path / "blobs.lance")
    rng = np.random.default_rng(0)  # incompressible and distinct, like JPEGs
    lance.write_dataset(pa.table({"id": [f"s:{i}" for i in range(64)], "image": pa.array(
        [rng.bytes(1 << 20) for _ in range(64)], pa.large_binary())}), uri.uri)
    options = blob_scanner_options(uri.open(), ["id", "image"])
    assert options["batch_size"] == READ_BATCH_BYTES // (1 << 20) - 1  # ids weigh a little
    assert blob_scanner_options(uri.open(), ["id"]) == {}
    configure_ray_data()  # what ray_runtime.connect sets: blocks of at most MAX_BLOCK_BYTES
    blocks = [b.nbytes for b in read_table(uri, columns=["id", "image"]).iter_batches(
        batch_size=None, batch_format="pyarrow")]
    assert sum(blocks) > 64 << 20 and max(blocks) <= MAX_BLOCK_BYTES + (1 << 20)


def test_reads_hold_no_cpu_slot_and_run_a_few_at_a_time():
    assert read_concurrency(2) == 1 and read_concurrency(64) == 64 // READ_TASK_CPUS
