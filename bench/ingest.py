"""Ingest: rows/s and MB/s into Lance through Ray Data, against a plain single-process
loop that reads the same files, reads their headers and writes one Lance table."""

from __future__ import annotations

import hashlib
import io
import shutil
import tempfile
from pathlib import Path

import lance
import pyarrow as pa
from PIL import Image

from bench.common import OUT, Figure, generated_jpegs, report, timed
from prx_assets.engine import ray_runtime
from prx_assets.stages.ingest.ingest import IngestOptions, build_raw_dataset
from prx_assets.stages.ingest.raw_rows import RAW_IMAGES_SCHEMA
from prx_assets.stages.ingest.sources import SourceSpec
from prx_assets.storage.lance_tables import FragmentPolicy, write_dataset_atomically
from prx_assets.storage.refs import TableRef

N_IMAGES = 400


def baseline_loop(folder: Path, out: Path) -> int:
    """The naive single-process ingest a notebook would do."""
    rows = []
    for path in sorted(folder.glob("*.jpg")):
        data = path.read_bytes()
        with Image.open(io.BytesIO(data)) as img:
            width, height = img.size
        rows.append({"key": path.name, "image": data, "width": width, "height": height,
                     "sha256": hashlib.sha256(data).hexdigest()})
    lance.write_dataset(pa.Table.from_pylist(rows), out, mode="overwrite")
    return len(rows)


def pipeline(folder: Path, out: Path) -> int:
    spec = SourceSpec(name="bench", kind="image_folder", uri=str(folder))
    dataset = build_raw_dataset(spec, folder, IngestOptions(units_per_task=32))
    return write_dataset_atomically(dataset, TableRef.of(out), FragmentPolicy(),
                                    RAW_IMAGES_SCHEMA).rows


def main() -> list[Figure]:
    folder = generated_jpegs(OUT / "corpus_ingest", N_IMAGES)
    total_mb = sum(p.stat().st_size for p in folder.glob("*.jpg")) / 1e6
    ray_runtime.connect()
    tmp = Path(tempfile.mkdtemp(prefix="bench-ingest-"))
    try:
        pipeline(folder, tmp / "warm.lance")  # warm Ray workers and imports
        base_s, _ = timed(lambda: baseline_loop(folder, tmp / "base.lance"))
        pipe_s, rows = timed(lambda: pipeline(folder, tmp / "pipe.lance"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    figures = [
        Figure("ingest", "rows/s into Lance", rows / pipe_s, "single-process loop",
               N_IMAGES / base_s, "rows/s"),
        Figure("ingest", "MB/s into Lance", total_mb / pipe_s, "single-process loop",
               total_mb / base_s, "MB/s"),
    ]
    report(figures, "ingest")
    return figures


if __name__ == "__main__":
    main()
