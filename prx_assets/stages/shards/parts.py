"""Writing parts: consecutive id-sorted rows of one leaf, fetched by Lance row id and written
as MDS shards (`shard_writer`, the bytes of mosaicml-streaming's `MDSWriter` without its
torch import; compressed shards through `MDSWriter` itself), one Ray task per few parts.

A part on an object store is written shard by shard through the part's `Location` (an S3
client built from the handle's settings): no credential goes into the environment of the
task (MDSWriter's own uploader would read them from there); compressed shards go through a
local temporary folder, about one shard at a time (`part_writer`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import lance
import numpy as np
import pyarrow as pa
import ray

from prx_assets.engine.progress import StageProgress
from prx_assets.stages.shards.plan import (
    MDS_COLUMNS,
    PROVENANCE_COLUMNS,
    SampleInputs,
    WriteOptions,
)
from prx_assets.stages.shards.shard_writer import shard_writer
from prx_assets.storage.failpoints import failpoint
from prx_assets.storage.filters import in_filter
from prx_assets.storage.refs import Location

IMAGE_COLUMNS = ["id", "source", "image", "width", "height", "original_width", "original_height"]
TAKE_ROWS = 64  # rows fetched from Lance per read inside a task (bounded memory)
# Below this many rows per task, splitting a source's parts over more CPUs costs more than it
# saves (a task's start; its worker imports no torch since `shard_writer`: 10,000 before).
MIN_ROWS_PER_TASK = 1_000


@dataclass(frozen=True)
class PartSpec:
    """One part's work: consecutive id-sorted rows of one leaf."""

    out: Location  # the part's folder: local, or an s3:// prefix (uploaded shard by shard)
    # Kept in Arrow on the driver (a source's specs are built at once): a Python string per
    # sample only inside the task, TAKE_ROWS at a time. One Array, not a ChunkedArray: a
    # pickled Array slice carries its own rows, a ChunkedArray slice the whole buffer.
    ids: pa.Array | list[str]
    image_rows: np.ndarray  # Lance row ids in bucketed_images
    caption_rows: np.ndarray  # Lance row ids in captions


def part_specs(leaf_rows: pa.Table, leaf_dir: Location, rows_per_part: int) -> list[PartSpec]:
    """The leaf's rows cut into parts of `rows_per_part`, each in its own folder."""
    specs = []
    for n, start in enumerate(range(0, leaf_rows.num_rows, rows_per_part)):
        rows = leaf_rows.slice(start, rows_per_part)
        specs.append(PartSpec(
            out=leaf_dir / f"part.{n:05d}", ids=rows["id"].combine_chunks(),
            image_rows=rows["image_row"].to_numpy(), caption_rows=rows["caption_row"].to_numpy()))
    return specs


@dataclass
class OpenedInputs:
    """A task's inputs, each opened once for all its parts (an open reads the manifest: a
    few ms each, which per part and per read of provenance added up to a second at 2,000
    samples)."""

    bucketed: lance.LanceDataset
    captions: lance.LanceDataset
    raw: lance.LanceDataset | None
    provenance: list[str]  # the provenance columns the raw table has

    @classmethod
    def of(cls, inputs: SampleInputs) -> OpenedInputs:
        raw = inputs.raw.open() if inputs.raw is not None else None
        columns = [c for c in PROVENANCE_COLUMNS if raw is not None and c in raw.schema.names]
        return cls(inputs.bucketed.open(), inputs.captions.open(), raw, columns)


def write_part(spec: PartSpec, inputs: SampleInputs, options: WriteOptions,
               opened: OpenedInputs | None = None) -> list[dict]:
    """Write one part (in a Ray task, or in this process); returns its shard entries."""
    opened = opened or OpenedInputs.of(inputs)
    with _writer(spec.out, options) as writer:
        for start in range(0, len(spec.ids), TAKE_ROWS):
            stop = start + TAKE_ROWS
            images = _rows_by_id(opened.bucketed._take_rows(
                spec.image_rows[start:stop].tolist(), columns=IMAGE_COLUMNS))
            texts = _rows_by_id(opened.captions._take_rows(
                spec.caption_rows[start:stop].tolist(), columns=["id", "caption"]))
            ids = _as_strings(spec.ids[start:stop])
            origins = provenance_by_id(opened, ids)
            for sample_id in ids:
                writer.write(_sample(images[sample_id], texts[sample_id]["caption"],
                                     inputs.license, origins.get(sample_id)))
            failpoint("mds.write_part")
    return json.loads(json.dumps(writer.shards))


def _writer(out: Location, options: WriteOptions) -> AbstractContextManager:
    """The torch-free writer (`shard_writer`); streaming's for compressed shards."""
    if options.compression:
        # Imported here: streaming pulls in torch and transformers (~6 s of CPU), which
        # only a run writing compressed shards pays.
        from prx_assets.stages.shards.part_writer import part_writer

        return part_writer(out, options)
    return shard_writer(out, MDS_COLUMNS, options.size_limit)


def _as_strings(ids: pa.Array | list[str]) -> list[str]:
    return ids if isinstance(ids, list) else ids.to_pylist()


def _rows_by_id(table: pa.Table) -> dict[str, dict]:
    return {row["id"]: row for row in table.to_pylist()}


def provenance_by_id(opened: OpenedInputs, ids: list[str]) -> dict[str, dict]:
    """The provenance columns of `ids` in raw_images (one indexed `id IN` read of a few
    dozen ids); {} without the table or for a table of an older schema."""
    if opened.raw is None or not opened.provenance or not ids:
        return {}
    rows = opened.raw.to_table(columns=["id", *opened.provenance], filter=in_filter("id", ids))
    return _rows_by_id(rows)


def _sample(row: dict, caption: str, license: str, origin: dict | None = None) -> dict:
    origin = origin or {}
    return {"image": bytes(row["image"]), "caption": caption, "id": row["id"],
            "source": row["source"], "width": int(row["width"]), "height": int(row["height"]),
            "original_width": int(row["original_width"]),
            "original_height": int(row["original_height"]),
            "license": origin.get("license") or license,
            **{c: origin.get(c) or "" for c in ("url", "license_url", "attribution")}}


def write_parts(specs: list[PartSpec], inputs: SampleInputs, options: WriteOptions
                ) -> list[list[dict]]:
    opened = OpenedInputs.of(inputs)
    return [write_part(spec, inputs, options, opened) for spec in specs]


_write_parts_task = ray.remote(num_cpus=1)(write_parts)


def run_parts(specs: list[PartSpec], inputs: SampleInputs, options: WriteOptions,
              log: Callable[[str], None], stage: str = "mds_shards") -> list[list[dict]]:
    """All parts (as Ray tasks unless `options.parallel` is off); results in the order of
    `specs`; progress (samples written out of those planned) logged as tasks end, as one
    `stage` line at most every 10 s."""
    progress = StageProgress(stage, sum(len(spec.ids) for spec in specs), log,
                             unit="samples")
    if not options.parallel:
        results, opened = [], OpenedInputs.of(inputs)
        for spec in specs:
            results.append(write_part(spec, inputs, options, opened))
            progress.advance(len(spec.ids))
        progress.finish()
        return results
    inputs_ref, options_ref = ray.put(inputs), ray.put(options)
    groups = task_groups(specs, rows_per_task(specs, options.rows_per_part,
                                              ray.cluster_resources().get("CPU", 1)))
    refs = [_write_parts_task.remote(group, inputs_ref, options_ref) for group in groups]
    samples = {ref: sum(len(spec.ids) for spec in group)
               for ref, group in zip(refs, groups, strict=True)}
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        ray.get(ready)  # surface a failed task now
        progress.advance(samples[ready[0]])
    progress.finish()
    return [entries for group in ray.get(refs) for entries in group]


def rows_per_task(specs: list[PartSpec], rows_per_part: int, cpus: float) -> int:
    """Rows a task packs: up to a part's, but few enough that every CPU gets a task (a
    source of a million samples in small leaves was a handful of tasks for its CPUs), and
    not under MIN_ROWS_PER_TASK."""
    total = sum(len(spec.ids) for spec in specs)
    spread = max(MIN_ROWS_PER_TASK, math.ceil(total / max(1, int(cpus))))
    return max(1, min(rows_per_part, spread))


def task_groups(specs: list[PartSpec], rows_per_task: int) -> list[list[PartSpec]]:
    """Consecutive parts packed into tasks of up to `rows_per_task` rows: a source with many
    small leaves (one part each) would otherwise pay a task's start-up per leaf."""
    groups: list[list[PartSpec]] = []
    rows = 0
    for spec in specs:
        if not groups or rows + len(spec.ids) > rows_per_task:
            groups.append([])
            rows = 0
        groups[-1].append(spec)
        rows += len(spec.ids)
    return groups
