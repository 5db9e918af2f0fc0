"""Ingest a source into `raw_images` rows as a lazy, streaming Ray Dataset.

The driver lists units (files, tars, parquet files) into small manifest files as it walks,
so listing a huge folder never holds every path in memory; Ray tasks then expand units
into rows, probe headers, and stream bounded Arrow tables to the writer.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq
import ray.data

from prx_assets.engine.failpoints import failpoint
from prx_assets.s1_ingest import readers
from prx_assets.storage.lance_tables import prepare_output_dir, tag_with_node
from prx_assets.s1_ingest.probe import DEFAULT_MAX_PIXELS
from prx_assets.s1_ingest.raw_rows import RAW_IMAGES_SCHEMA, FoundItem, raw_row, rows_to_tables
from prx_assets.s1_ingest.sources import SourceSpec

MANIFEST_CHUNK = 10_000


@dataclass(frozen=True)
class IngestOptions:
    max_pixels: int = DEFAULT_MAX_PIXELS
    max_file_bytes: int = readers.DEFAULT_MAX_FILE_BYTES
    units_per_task: int = 64  # files per task for image folders; tars/parquet go one by one


def write_manifest(spec: SourceSpec, uri: Path, manifest_dir: Path) -> int:
    """List the source's units into parquet chunks; returns how many units there are."""
    prepare_output_dir(manifest_dir, "ingest manifest")
    manifest_dir.mkdir(exist_ok=True)
    chunk: list[str] = []
    count = 0
    for unit in readers.list_units(spec, uri):
        chunk.append(unit)
        if len(chunk) >= MANIFEST_CHUNK:
            _write_manifest_chunk(manifest_dir, count, chunk)
            count += len(chunk)
            chunk = []
    if chunk or count == 0:
        _write_manifest_chunk(manifest_dir, count, chunk)
        count += len(chunk)
    return count


def _write_manifest_chunk(manifest_dir: Path, start: int, units: list[str]) -> None:
    table = pa.table({"unit": pa.array(units, pa.string())})
    pq.write_table(table, manifest_dir / f"units-{start:012d}.parquet")


def _read_manifest_chunks(chunks: pa.Table) -> Iterator[pa.Table]:
    for path in chunks.column("chunk").to_pylist():
        yield pq.read_table(path)


def expand_units(units: pa.Table, spec: SourceSpec, uri: str, options: IngestOptions
                 ) -> Iterator[pa.Table]:
    """Ray map_batches UDF: a batch of unit paths -> bounded tables of raw rows."""
    root = Path(uri)
    for table in rows_to_tables(
        raw_row(spec.name, item, options.max_pixels)
        for unit in units.column("unit").to_pylist()
        for item in _items_of_unit(spec, root, unit, options)
    ):
        yield tag_with_node(table)
        failpoint("ingest.expand_units")


def _items_of_unit(spec: SourceSpec, root: Path, unit: str, options: IngestOptions
                   ) -> Iterator[FoundItem]:
    if readers.is_folder_unit(unit):
        yield readers.unreadable_folder_item(unit)
    elif spec.kind == "image_folder":
        yield readers.read_image_file(spec, root, unit, options.max_file_bytes)
    elif spec.kind == "webdataset":
        yield from readers.read_tar(spec, root, unit, options.max_file_bytes)
    elif spec.kind == "parquet":
        yield from readers.read_parquet_file(spec, root, unit,
                                             max_file_bytes=options.max_file_bytes)
    else:
        raise ValueError(f"kind {spec.kind!r} has no units")


def lance_records_to_rows(batch: pa.Table, spec: SourceSpec, options: IngestOptions
                          ) -> pa.Table:
    rows = [raw_row(spec.name, readers.lance_record_item(spec, record), options.max_pixels)
            for record in batch.to_pylist()]
    return tag_with_node(pa.Table.from_pylist(rows, schema=RAW_IMAGES_SCHEMA))


def build_raw_dataset(spec: SourceSpec, uri: Path, work_dir: Path,
                      options: IngestOptions = IngestOptions()) -> ray.data.Dataset:
    """The lazy dataset of `raw_images` rows for one source (nothing runs until written).

    `work_dir` holds the manifest; the caller removes it once the dataset is written.
    """
    readers.check_source_exists(spec, uri)
    if spec.kind == "lance":
        columns = [c for c in (spec.key_column, spec.image_column, spec.caption_column,
                               spec.url_column) if c]
        return ray.data.read_lance(str(uri), columns=columns).map_batches(
            functools.partial(lance_records_to_rows, spec=spec, options=options),
            batch_format="pyarrow", batch_size=64,
        )
    manifest_dir = work_dir / "manifest"
    write_manifest(spec, uri, manifest_dir)
    # Tars and parquet files are big units: one per task keeps the shards parallel.
    per_task = options.units_per_task if spec.kind == "image_folder" else 1
    # Manifest chunks are read inside tasks (read_parquet's file listing costs seconds per
    # run); then small blocks of units let the expensive expansion spread over every node.
    chunks = [{"chunk": str(path)} for path in sorted(manifest_dir.glob("*.parquet"))]
    units = ray.data.from_items(chunks).map_batches(
        _read_manifest_chunks, batch_size=1, batch_format="pyarrow",
    ).repartition(target_num_rows_per_block=per_task)
    return units.map_batches(
        functools.partial(expand_units, spec=spec, uri=str(uri), options=options),
        batch_format="pyarrow", batch_size=per_task,
    )
