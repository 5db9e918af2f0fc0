"""Reads of Lance tables: a lazy Ray Data read at a table handle's version, batched by
bytes where the columns hold blobs, and the byte size of a table's data files.

The lowest module that opens a table besides `refs.py`: `TableRef.read` calls
`read_table`, and this module needs only the handle's URI, version and settings, so it
imports no other storage module (no cycle through `refs.py`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import ray

from prx_assets.storage.object_store import is_object_store

if TYPE_CHECKING:
    import lance

    from prx_assets.storage.refs import TableRef


# What one read batch (one Ray block) of a table holding blobs should weigh. Lance's
# default batch is 8,192 rows: 600 MB of images per batch, held by the read task and again
# in the object store (the read worker peaked at 1.5 GB of PSS on a 1,000-image source).
READ_BATCH_BYTES = 16 << 20
# Batches a read task decodes ahead, and Lance's I/O buffer (default 2 GB) per read.
READ_BATCH_READAHEAD = 2
READ_IO_BUFFER_BYTES = 64 << 20


# A read task waits on storage and on backpressure from the stage it feeds, not on the
# CPU (Lance decodes on its own threads). Charged one CPU, a read of raw_images held one of
# a 2-CPU node's two slots for the whole image stage: the decoding map ran one task at a
# time. Reads take no CPU slot; their number is capped instead, one per READ_TASK_CPUS CPUs.
READ_TASK_CPUS = 4


def read_table(table: TableRef, columns: list[str] | None = None,
               **kwargs: Any) -> ray.data.Dataset:
    """`ray.data.read_lance` of `table` at its version, with its settings (Ray tasks read
    with them whatever environment their worker process started with); read batches sized
    by bytes when the columns read hold blobs (`blob_scanner_options`); read tasks without
    a CPU slot, a few at a time (`read_concurrency`)."""
    scanner_options = {**blob_scanner_options(table.open(), columns),
                       **kwargs.pop("scanner_options", {})}
    kwargs.setdefault("num_cpus", 0)
    kwargs.setdefault("concurrency", read_concurrency())
    return ray.data.read_lance(table.uri, version=table.version, columns=columns,
                               storage_options=table.lance_options(),
                               scanner_options=scanner_options or None, **kwargs)


def read_concurrency(cpus: float | None = None) -> int:
    """Read tasks at once: one per READ_TASK_CPUS CPUs of the cluster (of this machine while
    Ray is not started yet: `read_lance` starts it), at least one."""
    if cpus is None:
        cpus = (ray.cluster_resources().get("CPU", 1) if ray.is_initialized()
                else os.cpu_count() or 1)
    return max(1, int(cpus // READ_TASK_CPUS))


def blob_scanner_options(table: lance.LanceDataset, columns: list[str] | None) -> dict:
    """Scanner options that keep a read of blob columns (images) to ~READ_BATCH_BYTES per
    batch; none for metadata columns, whose default batches are small and few."""
    names = columns or table.schema.names
    blobs = [n for n in names if pa.types.is_large_binary(table.schema.field(n).type)
             or pa.types.is_binary(table.schema.field(n).type)]
    rows = table.count_rows()
    if not blobs or rows == 0:
        return {}
    row_bytes = max(1, data_bytes(table) // rows)  # all columns: an upper bound
    return {"batch_size": max(1, min(8192, READ_BATCH_BYTES // row_bytes)),
            "batch_readahead": READ_BATCH_READAHEAD, "io_buffer_size": READ_IO_BUFFER_BYTES}


def data_bytes(table: lance.LanceDataset) -> int:
    """Bytes of the table's data files (from the manifest; a local file's size if not)."""
    total = 0
    for fragment in table.get_fragments():
        for data_file in fragment.data_files():
            size = getattr(data_file, "file_size_bytes", None)
            if size is None and not is_object_store(table.uri):
                size = (Path(table.uri) / "data" / data_file.path).stat().st_size
            if size is None:
                raise ValueError(f"{table.uri}: data file {data_file.path} records no size")
            total += size
    return total
