"""Mosaic Data Shards: the per-source tree the trainer streams, written from Lance.

Layout (see docs/mds.md and `trees.py`):

    $PRX_DATA_ROOT/mds/<source>                -> .trees/<source>/<tree_version>  (symlink)
    $PRX_DATA_ROOT/mds/<source>.current.json   names the current version (s3:// roots)
    $PRX_DATA_ROOT/mds/.trees/<source>/<tree_version>/<tier>/<W>x<H>/index.json + shard.NNNNN.mds

Every run makes a new tree version aside and publishes it last (symlink replaced, or the
pointer object PUT), so a reader sees one whole tree; a killed run leaves the previous tree
current. The mapping table `lance/mds_samples/<source>.lance` says where every live id of
the current tree is stored.

Incremental by default: the pinned inputs are compared with the mapping table by id and a
fingerprint of cheap columns (`sample_fingerprints`). New and changed samples are written as
new shards appended to their leaves; the new version's index lists the old shards unchanged
(hard-linked locally, server-side copied on S3) plus the new ones, numbering continuing.
Removed samples and the old copies of changed ones stay in their shards, skipped through the
sidecars under the reason `stale` until a rewrite. Nothing changed: no new version at all. A
change of the settings (size limit, compression, caption filter) or no usable previous tree
means a full build.

Writing: the driver plans from metadata only (ids, shapes, Lance row ids, no image bytes),
sorts each leaf by id and cuts it into parts of fixed row counts; Ray tasks fetch their rows
by row id from Lance and write each part with mosaicml-streaming's `MDSWriter` (on S3 into
a bounded local temporary folder, each shard uploaded and removed as it is finished); the
driver renames the parts' shards into one sequence per leaf and merges their indexes. Same
inputs, same options: byte-identical shards.
"""

from __future__ import annotations

import json
import logging
import math
import multiprocessing
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional

import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray
from streaming import MDSWriter

from prx_assets.engine.failpoints import failpoint
from prx_assets.engine.progress import StageProgress
from prx_assets.stages.shards.trees import (  # layout names re-exported for existing callers
    PARTIAL_SUFFIX, TREE_MANIFEST, TREES_DIR, TreeStore, leaf_names, new_tree_version,  # noqa: F401
    tree_store)
from prx_assets.stages.skip_lists.skip_lists import (
    REASON_STALE, read_sidecar, sidecar_body, sidecar_uri)
from prx_assets.storage import object_store
from prx_assets.storage.filters import in_filter
from prx_assets.storage.lance_tables import prepare_output_dir
from prx_assets.storage.layout import Storage, as_storage
from prx_assets.storage.tables import MDS_SAMPLES

logger = logging.getLogger(__name__)

# The design's MDS sample. `image` is declared `jpeg` so any StreamingDataset decodes it to a
# PIL image, but we hand MDSWriter the bytes: `mds_encode` stores bytes as they are, so the
# pipeline's Q92 JPEG is never re-encoded (the `jpeg` encoder would save a PIL image at Q75).
MDS_COLUMNS = {
    "image": "jpeg",
    "caption": "str",
    "id": "str",
    "source": "str",
    "width": "int",
    "height": "int",
    "original_width": "int",
    "original_height": "int",
}
IMAGE_COLUMNS = ["id", "source", "image", "width", "height", "original_width", "original_height"]
# What a sample's fingerprint is made of: columns read without touching image bytes or
# caption text. The image stage rewrites a changed image's row (new phash, pixels, shape);
# the captions stage writes a new caption row (new created_at, n_words) when it re-captions.
FINGERPRINT_IMAGE_COLUMNS = ["tier", "width", "height", "original_width", "original_height",
                             "phash", "pixels"]
FINGERPRINT_CAPTION_COLUMNS = ["created_at", "n_words"]

MDS_SAMPLES_SCHEMA = pa.schema([
    pa.field("id", pa.string(), nullable=False),
    pa.field("source", pa.string(), nullable=False),
    pa.field("tier", pa.int32(), nullable=False),
    pa.field("width", pa.int32(), nullable=False),
    pa.field("height", pa.int32(), nullable=False),
    pa.field("leaf", pa.string(), nullable=False),  # relative to mds/<source>, e.g. 512/512x512
    pa.field("shard", pa.string(), nullable=False),  # e.g. shard.00000.mds
    pa.field("sample_index", pa.int64(), nullable=False),  # shard-local
    pa.field("tree_version", pa.string(), nullable=False),  # the version that wrote the shard
    pa.field("fingerprint", pa.int64(), nullable=False),  # see sample_fingerprints
])

DEFAULT_SIZE_LIMIT = 128 << 20  # ~128 MB shards, the design's size
DEFAULT_ROWS_PER_PART = 50_000  # one Ray task per part: ~5-20 GB of JPEGs, a few dozen shards
TAKE_ROWS = 64  # rows fetched from Lance per read inside a task (bounded memory)
MDS_DIR = "mds"


@dataclass(frozen=True)
class SampleInputs:
    """Where a source's samples come from: kept bucketed rows joined with usable captions."""

    bucketed_uri: str
    captions_uri: str
    caption_filter: str  # Lance SQL selecting the active, usable caption rows
    bucketed_version: int | None = None
    captions_version: int | None = None
    exclude_ids: frozenset[str] = frozenset()  # e.g. a rewrite without skipped samples
    # Lance storage options for object-store inputs (resolved on the driver, see Storage).
    storage_options: Optional[Mapping[str, str]] = field(default=None, hash=False, compare=False)


@dataclass(frozen=True)
class WriteOptions:
    size_limit: int = DEFAULT_SIZE_LIMIT
    compression: str | None = None  # JPEG bytes do not compress further
    rows_per_part: int = DEFAULT_ROWS_PER_PART
    keep_trees: int = 2  # the current tree and the one before (a trainer may still read it)
    parallel: bool = True  # Ray tasks; False writes the parts in this process (tiny sources)
    incremental: bool = True  # False: always a full build (a rewrite, a byte-identity check)


@dataclass(frozen=True)
class LeafReport:
    tier: int
    width: int
    height: int
    samples: int  # live samples (stored minus stale)
    shards: int
    bytes: int

    @property
    def name(self) -> str:
        return leaf_name(self.tier, self.width, self.height)


@dataclass
class TreeReport:
    source: str
    tree_version: str
    path: Path | str  # a local folder, or the version's s3:// prefix
    mapping_uri: str
    mapping_version: int
    left_out: Counter = field(default_factory=Counter)
    leaves: list[LeafReport] = field(default_factory=list)
    processed: int = 0  # samples written by this run
    reused: int = 0  # live samples carried in old shards
    removed: int = 0  # samples newly skipped as stale (or, in a full build, gone)
    changed: bool = True  # False: nothing changed, no new version was made
    appended: bool = False  # True: old shards carried, new shards appended

    @property
    def samples(self) -> int:
        return sum(leaf.samples for leaf in self.leaves)

    @property
    def shards(self) -> int:
        return sum(leaf.shards for leaf in self.leaves)

    @property
    def bytes(self) -> int:
        return sum(leaf.bytes for leaf in self.leaves)


@dataclass(frozen=True)
class PartSpec:
    """One Ray task's work: consecutive id-sorted rows of one leaf."""

    out: Path | str  # a local folder, or an s3:// prefix (written through a local temp dir)
    ids: list[str]
    image_rows: np.ndarray  # Lance row ids in bucketed_images
    caption_rows: np.ndarray  # Lance row ids in captions


# ---------------------------------------------------------------------------------- layout

def leaf_name(tier: int, width: int, height: int) -> str:
    return f"{tier}/{width}x{height}"


def _as_mds_root(root: Path, source: str) -> Path:
    """Accept either the MDS root or the data root above it."""
    root = Path(root)
    if not os.path.lexists(root / source) and os.path.lexists(root / MDS_DIR / source):
        return root / MDS_DIR
    return root


def current_tree(root: Path, source: str) -> Path:
    """The source's current local tree, resolved once (a later swap does not move what you
    hold). `root` is the MDS root (`$PRX_DATA_ROOT/mds`); the data root above it is accepted
    too. For any root, local or s3://, see `current_tree_uri`."""
    link = _as_mds_root(root, source) / source
    if not link.exists():
        raise FileNotFoundError(f"no MDS tree for source {source!r} at {link}; "
                                "materialise mds_shards first")
    return link.resolve()


def current_tree_uri(storage: Storage | str | Path, source: str) -> str:
    """The current tree of `source` as a location: a resolved local folder or the version's
    `s3://` prefix (what `prx-assets mds-uri` prints; `<it>/<tier>/<W>x<H>` is a stream)."""
    return tree_store(as_storage(storage), source).current_tree()


def tree_leaves(tree: Path, tier: int | None = None) -> list[Path]:
    """Leaf folders (those holding index.json) of a tree, optionally of one tier, sorted."""
    pattern = f"{tier}/*/index.json" if tier is not None else "*/*/index.json"
    return sorted(p.parent for p in Path(tree).glob(pattern))


def leaf_samples(leaf: Path | str, storage_options: Mapping[str, str] | None = None) -> int:
    return sum(shard["samples"] for shard in read_index(str(leaf), storage_options))


def read_index(leaf: str, storage_options: Mapping[str, str] | None = None) -> list[dict]:
    """A leaf's index.json shard entries (local folder or s3:// prefix)."""
    return json.loads(object_store.read_text(f"{leaf}/index.json", storage_options))["shards"]


# ---------------------------------------------------------------------------------- planning

def plan_samples(inputs: SampleInputs) -> tuple[pa.Table, Counter]:
    """Kept rows with a usable caption, sorted by (tier, width, height, id), each with its
    fingerprint, plus the rows left out by reason. Reads ids, shapes, row ids and the
    fingerprint columns only: no image bytes, no caption text."""
    bucketed = lance.dataset(inputs.bucketed_uri, version=inputs.bucketed_version,
                             storage_options=inputs.storage_options)
    present = set(bucketed.schema.names)
    extra = [c for c in FINGERPRINT_IMAGE_COLUMNS if c in present and c not in
             ("tier", "width", "height")]
    kept = bucketed.to_table(columns=["id", "tier", "width", "height", *extra],
                             filter="status = 'ok'", with_row_id=True)
    kept = kept.rename_columns([*kept.column_names[:-1], "image_row"])
    captions = lance.dataset(inputs.captions_uri, version=inputs.captions_version,
                             storage_options=inputs.storage_options)
    caption_extra = [c for c in FINGERPRINT_CAPTION_COLUMNS if c in captions.schema.names]
    usable = captions.to_table(columns=["id", *caption_extra], filter=inputs.caption_filter,
                               with_row_id=True)
    # Several usable rows for one id should not happen; take the first written, deterministically.
    usable = usable.group_by("id").aggregate(
        [("_rowid", "min"), *((c, "max") for c in caption_extra)])
    usable = usable.rename_columns(["id", "caption_row", *(f"caption_{c}" for c in caption_extra)])
    joined = kept.join(usable, "id", join_type="left outer")
    left_out: Counter = Counter()
    if inputs.exclude_ids:
        excluded = pc.is_in(joined["id"], value_set=pa.array(sorted(inputs.exclude_ids)))
        left_out["excluded"] = pc.sum(excluded).as_py() or 0
        joined = joined.filter(pc.invert(excluded))
    missing = pc.is_null(joined["caption_row"])
    left_out["no_caption"] = pc.sum(missing).as_py() or 0
    joined = joined.filter(pc.invert(missing))
    parts = [*FINGERPRINT_IMAGE_COLUMNS, *(f"caption_{c}" for c in FINGERPRINT_CAPTION_COLUMNS)]
    joined = joined.append_column("fingerprint", sample_fingerprints(
        joined, [c for c in parts if c in joined.column_names]))
    order = [("tier", "ascending"), ("width", "ascending"), ("height", "ascending"),
             ("id", "ascending")]
    plan = joined.select(["id", "tier", "width", "height", "image_row", "caption_row",
                          "fingerprint"])
    return plan.sort_by(order), +left_out


def sample_fingerprints(table: pa.Table, columns: list[str]) -> pa.Array:
    """A 64-bit mix of integer-like columns per row (nulls as 0): equal inputs, equal
    fingerprint. Changed means a different fingerprint; documented in docs/mds.md."""
    mixed = np.zeros(table.num_rows, np.uint64)
    with np.errstate(over="ignore"):
        for name in columns:
            column = table[name]
            if pa.types.is_timestamp(column.type):
                column = column.cast(pa.int64())
            values = pc.fill_null(column.cast(pa.int64()), 0).to_numpy().astype(np.uint64)
            mixed = (mixed ^ values) * np.uint64(0x9E3779B97F4A7C15)
            mixed ^= mixed >> np.uint64(31)
    return pa.array(mixed.view(np.int64), pa.int64())


@dataclass
class Delta:
    """What an incremental run changes, against the current tree's mapping table."""

    write: pa.Table  # plan rows to write: new ids and changed ids, in plan order
    stale: pa.Table  # mapping rows (id, leaf, shard, sample_index) newly superseded
    removed_ids: list[str]  # ids leaving the mapping (not in the plan any more)
    reused: int  # live samples carried over unchanged

    @property
    def empty(self) -> bool:
        return self.write.num_rows == 0 and self.stale.num_rows == 0


def plan_delta(plan: pa.Table, mapping: pa.Table) -> Delta:
    """New / changed / removed / unchanged ids, from the plan's and the mapping's
    fingerprints (ids and a few integers per row; no image bytes)."""
    old = mapping.select(["id", "fingerprint", "leaf", "shard", "sample_index"]) \
        .rename_columns(["id", "old_fingerprint", "leaf", "shard", "sample_index"])
    joined = plan.select(["id", "fingerprint"]).join(old, "id", join_type="full outer")
    in_plan = pc.is_valid(joined["fingerprint"])
    in_old = pc.is_valid(joined["old_fingerprint"])
    differs = pc.fill_null(pc.not_equal(joined["fingerprint"], joined["old_fingerprint"]), True)
    to_write = pc.and_(in_plan, differs)
    superseded = pc.and_(in_old, differs)
    write_ids = joined.filter(to_write)["id"]
    stale = joined.filter(superseded).select(["id", "leaf", "shard", "sample_index"])
    removed = joined.filter(pc.invert(in_plan))["id"].to_pylist()
    reused = int(pc.sum(pc.and_(in_old, pc.invert(differs))).as_py() or 0)
    write = plan.filter(pc.is_in(plan["id"], value_set=write_ids))
    return Delta(write=write, stale=stale, removed_ids=sorted(removed), reused=reused)


def split_leaves(plan: pa.Table) -> list[tuple[tuple[int, int, int], pa.Table]]:
    """The sorted plan cut into one slice per (tier, width, height), in order."""
    if plan.num_rows == 0:
        return []
    keys = list(zip(*(plan[c].to_pylist() for c in ("tier", "width", "height"))))
    leaves, start = [], 0
    for i in range(1, len(keys) + 1):
        if i == len(keys) or keys[i] != keys[start]:
            leaves.append((keys[start], plan.slice(start, i - start)))
            start = i
    return leaves


def part_specs(leaf_rows: pa.Table, leaf_dir: Path | str, rows_per_part: int,
               first: int = 0) -> list[PartSpec]:
    specs = []
    for n, start in enumerate(range(0, leaf_rows.num_rows, rows_per_part), start=first):
        rows = leaf_rows.slice(start, rows_per_part)
        out = (f"{leaf_dir}/part.{n:05d}" if object_store.is_object_store(leaf_dir)
               else Path(leaf_dir) / f"part.{n:05d}")
        specs.append(PartSpec(
            out=out, ids=rows["id"].to_pylist(),
            image_rows=rows["image_row"].to_numpy(), caption_rows=rows["caption_row"].to_numpy()))
    return specs


# ---------------------------------------------------------------------------------- writing

def write_part(spec: PartSpec, inputs: SampleInputs, options: WriteOptions) -> list[dict]:
    """Write one part with MDSWriter (runs in a Ray task); returns its index's shard entries.

    An s3:// part is written into a local temporary folder and each shard uploaded (and
    removed locally) as soon as it is finished: local disk holds about one shard."""
    bucketed = lance.dataset(inputs.bucketed_uri, version=inputs.bucketed_version,
                             storage_options=inputs.storage_options)
    captions = lance.dataset(inputs.captions_uri, version=inputs.captions_version,
                             storage_options=inputs.storage_options)
    remote = object_store.is_object_store(spec.out)
    if remote:
        # streaming's uploader is boto3 reading the environment (S3_ENDPOINT_URL included).
        os.environ.update(object_store.streaming_env(str(spec.out), inputs.storage_options))
    local = tempfile.mkdtemp(prefix="prx-mds-part-") if remote else str(spec.out)
    out = (local, str(spec.out)) if remote else local
    try:
        with MDSWriter(columns=MDS_COLUMNS, out=out, size_limit=options.size_limit,
                       compression=options.compression, exist_ok=True) as writer:
            for start in range(0, len(spec.ids), TAKE_ROWS):
                stop = start + TAKE_ROWS
                images = _rows_by_id(bucketed._take_rows(spec.image_rows[start:stop].tolist(),
                                                         columns=IMAGE_COLUMNS))
                texts = _rows_by_id(captions._take_rows(spec.caption_rows[start:stop].tolist(),
                                                        columns=["id", "caption"]))
                for sample_id in spec.ids[start:stop]:
                    writer.write(_sample(images[sample_id], texts[sample_id]["caption"]))
                failpoint("mds.write_part")
        return json.loads(json.dumps(writer.shards))
    finally:
        if remote:
            shutil.rmtree(local, ignore_errors=True)


def _rows_by_id(table: pa.Table) -> dict[str, dict]:
    return {row["id"]: row for row in table.to_pylist()}


def _sample(row: dict, caption: str) -> dict:
    return {"image": bytes(row["image"]), "caption": caption, "id": row["id"],
            "source": row["source"], "width": int(row["width"]), "height": int(row["height"]),
            "original_width": int(row["original_width"]),
            "original_height": int(row["original_height"])}


def run_parts(specs: list[PartSpec], inputs: SampleInputs, options: WriteOptions,
              log: Callable[[str], None], stage: str = "mds_shards") -> list[list[dict]]:
    """All parts as Ray tasks; results in the order of `specs`; progress (samples written
    out of those planned) logged as tasks end, as one `stage` line at most every 10 s."""
    progress = StageProgress(stage, sum(len(spec.ids) for spec in specs), log,
                             unit="samples")
    if not options.parallel:
        results = []
        for spec in specs:
            results.append(write_part(spec, inputs, options))
            progress.advance(len(spec.ids))
        progress.finish()
        return results
    inputs_ref, options_ref = ray.put(inputs), ray.put(options)
    groups = task_groups(specs, rows_per_task(specs, options.rows_per_part,
                                              ray.cluster_resources().get("CPU", 1)))
    refs = [_write_parts_task.remote(group, inputs_ref, options_ref) for group in groups]
    samples = {ref: sum(len(spec.ids) for spec in group) for ref, group in zip(refs, groups)}
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        ray.get(ready)  # surface a failed task now
        progress.advance(samples[ready[0]])
    progress.finish()
    return [entries for group in ray.get(refs) for entries in group]


# A task starts a worker that imports streaming (and torch): below this many rows per task,
# splitting a source's parts over more CPUs costs more than it saves.
MIN_ROWS_PER_TASK = 10_000


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


def write_parts(specs: list[PartSpec], inputs: SampleInputs, options: WriteOptions
                ) -> list[list[dict]]:
    return [write_part(spec, inputs, options) for spec in specs]


_write_parts_task = ray.remote(num_cpus=1)(write_parts)


def merge_leaf(store: TreeStore, leaf_dir: str, parts: list[tuple[PartSpec, list[dict]]],
               existing: list[dict] | None = None) -> list[dict]:
    """Move every part's shards into `leaf_dir` as one sequence, numbered after the
    `existing` entries (carried shards of an appended leaf), and write the leaf's index.

    (streaming's `merge_index` keeps each part in its own subfolder; renaming keeps the flat
    `shard.NNNNN.mds` layout that skip-list sidecars sit beside.)"""
    shards: list[dict] = list(existing or [])
    for spec, entries in parts:
        for entry in entries:
            number = len(shards)
            entry = json.loads(json.dumps(entry))  # a private copy to rename in
            for kind in ("raw_data", "zip_data"):
                info = entry.get(kind)
                if info:
                    old = f"{spec.out}/{info['basename']}"
                    info["basename"] = f"shard.{number:05d}.mds" + info["basename"].split(".mds", 1)[1]
                    if store.exists(old):
                        store.move(old, f"{leaf_dir}/{info['basename']}")
            shards.append(entry)
        store.delete_tree(str(spec.out))
    store.write_text(f"{leaf_dir}/index.json",
                     json.dumps({"version": 2, "shards": shards}, sort_keys=True))
    return shards


def mapping_rows(source: str, key: tuple[int, int, int], leaf_rows: pa.Table,
                 shards: list[dict], tree_version: str) -> pa.Table:
    """Mapping rows of `leaf_rows`, written (in order) as the shards `shards`."""
    counts = [entry["samples"] for entry in shards]
    if sum(counts) != leaf_rows.num_rows:
        raise RuntimeError(f"{leaf_name(*key)}: shards hold {sum(counts)} samples, "
                           f"planned {leaf_rows.num_rows}")
    n = leaf_rows.num_rows
    names = np.repeat([entry["raw_data"]["basename"] for entry in shards], counts)
    local = np.concatenate([np.arange(c, dtype=np.int64) for c in counts]) if counts else []
    tier, width, height = key
    return pa.table({
        "id": leaf_rows["id"],
        "source": pa.array([source] * n, pa.string()),
        "tier": pa.array(np.full(n, tier), pa.int32()),
        "width": pa.array(np.full(n, width), pa.int32()),
        "height": pa.array(np.full(n, height), pa.int32()),
        "leaf": pa.array([leaf_name(*key)] * n, pa.string()),
        "shard": pa.array(names.tolist(), pa.string()),
        "sample_index": pa.array(local, pa.int64()),
        "tree_version": pa.array([tree_version] * n, pa.string()),
        "fingerprint": leaf_rows["fingerprint"],
    }, schema=MDS_SAMPLES_SCHEMA)


# ---------------------------------------------------------------------------------- a build

def write_mds_tree(inputs: SampleInputs, storage: Storage | str | Path, source: str,
                   options: WriteOptions = WriteOptions(),
                   log: Callable[[str], None] = logger.info) -> TreeReport:
    """Make `source`'s tree match `inputs`: append what changed to a new version (or build
    one in full), commit the mapping table, then publish the version (in that order, see
    docs/mds.md for what a kill between the steps leaves and how the next run finishes it)."""
    storage = as_storage(storage)
    store = tree_store(storage, source, log)
    mapping_uri = storage.table(MDS_SAMPLES, source)
    store.prepare()
    prepare_output_dir(mapping_uri, "Lance table", storage.storage_options)
    inputs = _with_options(inputs, storage)
    finish_interrupted_publish(store, storage, source, log)
    plan, left_out = plan_samples(inputs)
    log(f"{source}: {plan.num_rows:,} samples planned; left out {dict(left_out) or 'none'}")
    current = store.current_version()
    settings = build_settings(inputs, options)
    mapping = _mapping_for_append(store, storage, source, current, settings, options)
    base_version = storage.latest_version(MDS_SAMPLES, source)
    if mapping is None:
        removed = _ids_gone(storage, source, plan)
        return _full_build(plan, left_out, store, storage, source, inputs, options, settings,
                           base_version, removed, log)
    delta = plan_delta(plan, mapping)
    del mapping
    if delta.empty:
        log(f"{source}: nothing changed since tree {current}; no new version")
        return _unchanged_report(store, storage, source, current, left_out)
    return _append_build(delta, left_out, store, storage, source, current, inputs, options,
                         settings, base_version, log)


def build_settings(inputs: SampleInputs, options: WriteOptions) -> dict:
    """What every shard of a tree depends on besides the samples: a change means a full
    build (the old shards would differ from new ones)."""
    return {"size_limit": options.size_limit, "compression": options.compression,
            "caption_filter": inputs.caption_filter, "columns": MDS_COLUMNS}


def _with_options(inputs: SampleInputs, storage: Storage) -> SampleInputs:
    if inputs.storage_options is not None or storage.is_local:
        return inputs
    import dataclasses

    return dataclasses.replace(inputs, storage_options=storage.lance_options())


def _mapping_for_append(store: TreeStore, storage: Storage, source: str,
                        current: Optional[str], settings: dict, options: WriteOptions
                        ) -> Optional[pa.Table]:
    """The mapping table to append against, or None when this run must build in full:
    first run, `incremental=False`, other settings, or a mapping of another layout."""
    if not options.incremental or current is None:
        return None
    manifest = store.manifest(current) or {}
    if manifest.get("settings") != json.loads(json.dumps(settings)):
        store.log(f"{source}: settings differ from tree {current}'s: full build")
        return None
    if not storage.exists(MDS_SAMPLES, source):
        return None
    table = storage.open(MDS_SAMPLES, source)
    if "fingerprint" not in table.schema.names:
        return None
    return table.to_table(columns=["id", "fingerprint", "leaf", "shard", "sample_index"])


def _ids_gone(storage: Storage, source: str, plan: pa.Table) -> int:
    """Ids of the previous mapping not planned any more (a full build's rows_removed)."""
    if not storage.exists(MDS_SAMPLES, source):
        return 0
    old = storage.open(MDS_SAMPLES, source).to_table(columns=["id"])["id"]
    return int(pc.sum(pc.invert(pc.is_in(old, value_set=plan["id"]))).as_py() or 0)


def _full_build(plan: pa.Table, left_out: Counter, store: TreeStore, storage: Storage,
                source: str, inputs: SampleInputs, options: WriteOptions, settings: dict,
                base_version: Optional[int], removed: int, log: Callable[[str], None]
                ) -> TreeReport:
    version = new_tree_version()
    staging = store.staging_uri(version)
    try:
        store.make_dirs(staging)  # an empty source still gets an (empty) tree
        written, mapping = _write_new_leaves(plan, store, staging, source, version, inputs,
                                             options, {}, log)
        leaves = _leaf_reports({}, {}, written)
        _write_manifest(store, staging, source, version, inputs, settings, base_version,
                        carried=[], samples=plan.num_rows,
                        keep_trees=options.keep_trees)
        final = store.finish(version)
    except BaseException:
        store.delete_tree(staging)
        raise
    mapping_version = write_mapping(mapping, storage.table(MDS_SAMPLES, source),
                                    storage.lance_options())
    return _publish(store, source, version, final, mapping_version, left_out, leaves, options,
                    log, mapping_uri=storage.table(MDS_SAMPLES, source),
                    processed=plan.num_rows, reused=0, removed=removed, appended=False)


def _append_build(delta: Delta, left_out: Counter, store: TreeStore, storage: Storage,
                  source: str, current: str, inputs: SampleInputs, options: WriteOptions,
                  settings: dict, base_version: Optional[int], log: Callable[[str], None]
                  ) -> TreeReport:
    version = new_tree_version()
    old_tree, staging = store.tree_uri(current), store.staging_uri(version)
    log(f"{source}: appending {delta.write.num_rows:,} samples to tree {current}; "
        f"{delta.stale.num_rows:,} become stale, {delta.reused:,} carried")
    old_manifest = store.manifest(current) or {}
    try:
        store.make_dirs(staging)
        existing, stale_per_shard = _carry_old_leaves(store, old_tree, staging, delta.stale)
        leaves, mapping = _write_new_leaves(delta.write, store, staging, source, version,
                                            inputs, options, existing, log)
        leaves = _leaf_reports(existing, stale_per_shard, leaves)
        _write_manifest(store, staging, source, version, inputs, settings, base_version,
                        carried=_lineage(old_manifest, current),
                        samples=sum(l.samples for l in leaves),
                        keep_trees=options.keep_trees, parent=current)
        final = store.finish(version)
    except BaseException:
        store.delete_tree(staging)
        raise
    mapping_version = update_mapping(mapping, delta.removed_ids,
                                     storage.table(MDS_SAMPLES, source),
                                     storage.lance_options())
    return _publish(store, source, version, final, mapping_version, left_out, leaves, options,
                    log, mapping_uri=storage.table(MDS_SAMPLES, source),
                    processed=delta.write.num_rows, reused=delta.reused,
                    removed=delta.stale.num_rows, appended=True)


def _carry_old_leaves(store: TreeStore, old_tree: str, staging: str, stale: pa.Table
                      ) -> tuple[dict[str, list[dict]], dict[tuple[str, str], int]]:
    """Every shard of the current tree into the new version (linked or server-side copied,
    never rewritten), each sidecar with the newly stale indices added; returns each leaf's
    index entries and each shard's stale count (all stale, old and new)."""
    newly: dict[tuple[str, str], list[int]] = {}
    for leaf, shard, index in zip(stale["leaf"].to_pylist(), stale["shard"].to_pylist(),
                                  stale["sample_index"].to_pylist()):
        newly.setdefault((leaf, shard), []).append(int(index))
    existing: dict[str, list[dict]] = {}
    stale_counts: dict[tuple[str, str], int] = {}
    carried: list[tuple[str, str]] = []
    for leaf in leaf_names(store, old_tree):
        entries = read_index(f"{old_tree}/{leaf}", store.storage_options)
        existing[leaf] = entries
        store.make_dirs(f"{staging}/{leaf}")
        sidecars = set(store.files(f"{old_tree}/{leaf}", ".skip.json"))
        for entry in entries:
            for kind in ("raw_data", "zip_data"):
                if entry.get(kind):
                    name = entry[kind]["basename"]
                    carried.append((f"{old_tree}/{leaf}/{name}", f"{staging}/{leaf}/{name}"))
            shard = entry["raw_data"]["basename"]
            old_sidecar = sidecar_uri(f"{old_tree}/{leaf}/{shard}")
            lists = read_sidecar(old_sidecar, store.storage_options) \
                if old_sidecar in sidecars else {}
            added = newly.pop((leaf, shard), [])
            if added:
                lists[REASON_STALE] = sorted(set(lists.get(REASON_STALE, [])) | set(added))
                store.write_text(sidecar_uri(f"{staging}/{leaf}/{shard}"), sidecar_body(lists))
            elif old_sidecar in sidecars:
                carried.append((old_sidecar, sidecar_uri(f"{staging}/{leaf}/{shard}")))
            stale_counts[(leaf, shard)] = len(lists.get(REASON_STALE, []))
        store.write_text(f"{staging}/{leaf}/index.json",
                         json.dumps({"version": 2, "shards": entries}, sort_keys=True))
    if newly:
        raise RuntimeError(f"mapping rows name shards the current tree lacks: {sorted(newly)[:3]}")
    store.carry_many(carried)
    return existing, stale_counts


def _write_new_leaves(plan: pa.Table, store: TreeStore, staging: str, source: str,
                      version: str, inputs: SampleInputs, options: WriteOptions,
                      existing: dict[str, list[dict]], log: Callable[[str], None]
                      ) -> tuple[dict[str, list[dict]], pa.Table]:
    """Write `plan`'s samples as new shards, appended to `existing` leaves or in new ones;
    returns the new shard entries per leaf and their mapping rows."""
    leaves = split_leaves(plan)
    specs_per_leaf = [part_specs(rows, f"{staging}/{leaf_name(*key)}", options.rows_per_part)
                      for key, rows in leaves]
    flat = [spec for specs in specs_per_leaf for spec in specs]
    log(f"{source}: {len(leaves)} leaves to write, {len(flat)} parts")
    results = iter(run_parts(flat, inputs, options, log, stage=f"mds_shards[{source}]"))
    written: dict[str, list[dict]] = {}
    tables = []
    for (key, rows), specs in zip(leaves, specs_per_leaf):
        name = leaf_name(*key)
        before = existing.get(name, [])
        store.make_dirs(f"{staging}/{name}")
        shards = merge_leaf(store, f"{staging}/{name}",
                            [(spec, next(results)) for spec in specs], before)
        written[name] = shards[len(before):]
        tables.append(mapping_rows(source, key, rows, written[name], version))
    mapping = pa.concat_tables(tables) if tables else MDS_SAMPLES_SCHEMA.empty_table()
    return written, mapping


def _leaf_reports(existing: dict[str, list[dict]], stale: dict[tuple[str, str], int],
                  written: dict[str, list[dict]]) -> list[LeafReport]:
    reports = []
    for name in sorted(set(existing) | set(written), key=_leaf_key):
        entries = [*existing.get(name, []), *written.get(name, [])]
        stored = sum(e["samples"] for e in entries)
        stale_n = sum(stale.get((name, e["raw_data"]["basename"]), 0) for e in entries)
        reports.append(LeafReport(*_leaf_key(name), samples=stored - stale_n,
                                  shards=len(entries),
                                  bytes=sum(e["raw_data"]["bytes"] for e in entries)))
    return reports


def _leaf_key(name: str) -> tuple[int, int, int]:
    tier, shape = name.split("/")
    width, height = shape.split("x")
    return int(tier), int(width), int(height)


def _write_manifest(store: TreeStore, staging: str, source: str, version: str,
                    inputs: SampleInputs, settings: dict, base_version: Optional[int], *,
                    carried: list[str], samples: int, keep_trees: int,
                    parent: Optional[str] = None) -> None:
    """tree.json, last inside the version: complete means it exists. `carried_versions`
    names the older versions whose shards this one also holds (with this version: the
    mapping's tree_version values; see `_lineage`);
    `mapping_base_version` lets a later run tell whether this build's mapping commit
    happened before a kill (see finish_interrupted_publish)."""
    store.write_text(f"{staging}/{TREE_MANIFEST}", json.dumps({
        "source": source, "tree_version": version, "samples": samples,
        "bucketed_version": inputs.bucketed_version, "captions_version": inputs.captions_version,
        "settings": settings, "carried_versions": carried, "parent": parent,
        "commits_mapping": True, "mapping_base_version": base_version,
        "keep_trees": keep_trees,
    }, indent=2, sort_keys=True))


def _lineage(manifest: dict, version: str) -> list[str]:
    """Every version whose shards the tree `version` holds (itself included)."""
    own = manifest.get("shards_of", version)  # a skip-lists version holds its parent's shards
    return sorted({*manifest.get("carried_versions", []), own})


def _publish(store: TreeStore, source: str, version: str, final: str, mapping_version: int,
             left_out: Counter, leaves: list[LeafReport], options: WriteOptions,
             log: Callable[[str], None], **counts) -> TreeReport:
    store.publish(version)
    store.prune(options.keep_trees)
    log(f"{source}: tree {version} is current ({sum(l.samples for l in leaves):,} live "
        f"samples, {sum(l.shards for l in leaves)} shards; {counts})")
    return TreeReport(source=source, tree_version=version,
                      path=Path(final) if store.is_local else final,
                      mapping_uri=counts.pop("mapping_uri"), mapping_version=mapping_version,
                      left_out=left_out, leaves=leaves, **counts)


def _unchanged_report(store: TreeStore, storage: Storage, source: str, current: str,
                      left_out: Counter) -> TreeReport:
    tree = store.tree_uri(current)
    table = storage.open(MDS_SAMPLES, source)
    live = Counter(table.to_table(columns=["leaf"])["leaf"].to_pylist())
    leaves = []
    for name in leaf_names(store, tree):
        entries = read_index(f"{tree}/{name}", store.storage_options)
        leaves.append(LeafReport(*_leaf_key(name), samples=live.get(name, 0),
                                 shards=len(entries),
                                 bytes=sum(e["raw_data"]["bytes"] for e in entries)))
    return TreeReport(source=source, tree_version=current,
                      path=Path(tree) if store.is_local else tree,
                      mapping_uri=storage.table(MDS_SAMPLES, source),
                      mapping_version=table.version, left_out=left_out, leaves=leaves,
                      processed=0, reused=sum(live.values()), removed=0, changed=False)


def finish_interrupted_publish(store: TreeStore, storage: Storage, source: str,
                               log: Callable[[str], None] = logger.info) -> None:
    """A run killed after its mapping commit but before publishing left a complete version
    the mapping already describes: publish it (roll forward). Any other unpublished version
    (killed before its mapping commit) is deleted."""
    current = store.current_version()
    newer = [v for v in store.versions() if current is None or v > current]
    keep: frozenset[str] = frozenset()
    if newer:
        manifest = store.manifest(newer[-1]) or {}
        latest = storage.latest_version(MDS_SAMPLES, source)
        expected = (manifest.get("mapping_base_version") or 0) + 1
        if manifest.get("commits_mapping") and latest == expected:
            log(f"{source}: tree {newer[-1]} was built and mapped but not published "
                "(a killed run); publishing it now")
            store.publish(newer[-1])
            keep = frozenset({newer[-1]})
    store.remove_unpublished(keep)


def write_mapping(mapping: pa.Table, uri: str,
                  storage_options: Optional[Mapping[str, str]] = None) -> int:
    """One overwrite commit: readers see the previous mapping or this one, never a mix."""
    prepare_output_dir(uri, "Lance table", storage_options)
    try:
        lance.dataset(uri, storage_options=storage_options)
        mode = "overwrite"
    except (ValueError, FileNotFoundError, OSError):
        mode = "create"
    return lance.write_dataset(mapping, uri, schema=MDS_SAMPLES_SCHEMA, mode=mode,
                               storage_options=storage_options).version


def update_mapping(new_rows: pa.Table, removed_ids: list[str], uri: str,
                   storage_options: Optional[Mapping[str, str]] = None) -> int:
    """One commit: rows of newly written samples in (a changed id's row replaced), rows of
    removed ids out; every other row untouched."""
    dataset = lance.dataset(uri, storage_options=storage_options)
    gone = in_filter("id", removed_ids) if removed_ids else None
    if new_rows.num_rows == 0:
        dataset.delete(gone)
        return lance.dataset(uri, storage_options=storage_options).version
    merge = dataset.merge_insert("id").when_matched_update_all().when_not_matched_insert_all()
    if gone:
        merge = merge.when_not_matched_by_source_delete(gone)
    merge.execute(new_rows)
    return lance.dataset(uri, storage_options=storage_options).version


def swap_current(link: Path, target: Path) -> None:
    """Point `link` at `target` atomically (kept for callers of the local layout)."""
    store = TreeStore(str(Path(link).parent), Path(link).name)
    if Path(target).parent != Path(store.trees_dir):
        raise ValueError(f"{target} is not a version of {store.trees_dir}")
    store.publish(Path(target).name)


# ---------------------------------------------------------------------------------- checking

@dataclass(frozen=True)
class LeafCheck:
    leaf: str
    streamed: int  # samples a plain StreamingDataset sees
    mapped: int  # rows of the mapping table for this leaf (live samples)
    stale: int = 0  # samples stored but skipped as stale (not in the mapping)

    @property
    def ok(self) -> bool:
        return self.streamed == self.mapped + self.stale


def verify_tree(storage: Storage | str | Path, source: str) -> tuple[list[LeafCheck], list[str]]:
    """Open every leaf of the current tree with `streaming.StreamingDataset` (from its remote
    on an object store) and compare its sample count with the mapping table plus the stale
    samples of its sidecars; also report mapping rows of a version the tree does not hold."""
    storage = as_storage(storage)
    store = tree_store(storage, source)
    tree = store.current_tree()
    version = store.current_version()
    lineage = set(_lineage(store.manifest(version) or {}, version))
    mapping = storage.open(MDS_SAMPLES, source).to_table(columns=["leaf", "tree_version"])
    problems = sorted({f"mapping rows of tree {v}, current is {version}"
                       for v in pc.unique(mapping["tree_version"]).to_pylist()
                       if v not in lineage})
    mapped = Counter(mapping["leaf"].to_pylist())
    leaves = leaf_names(store, tree)
    streamed = streamed_counts([f"{tree}/{leaf}" for leaf in leaves],
                               object_store.streaming_env(tree, storage.storage_options)
                               ) if leaves else []
    checks = []
    for leaf, count in zip(leaves, streamed):
        checks.append(LeafCheck(leaf, count, mapped.pop(leaf, 0),
                                stale_in_leaf(store, f"{tree}/{leaf}")))
    checks += [LeafCheck(name, 0, n) for name, n in sorted(mapped.items())]  # no such leaf
    return checks, problems


def stale_in_leaf(store: TreeStore, leaf: str) -> int:
    return sum(len(read_sidecar(path, store.storage_options).get(REASON_STALE, []))
               for path in store.files(leaf, ".skip.json"))


def streamed_counts(leaves: list[str], env: Mapping[str, str] | None = None) -> list[int]:
    """Samples per leaf as one plain StreamingDataset (a stream per leaf) sees them; `s3://`
    leaves are streams with that remote and a temporary local cache (`env`: the settings
    streaming's boto3 client reads).

    Runs in a spawned process: every StreamingDataset registers shared-memory objects that
    later datasets in the same process keep open (thousands of descriptors after a few dozen
    leaves), so a long-lived process such as a Dagster run must not create them itself.

    A Pool is not used: leaving it terminates its worker with SIGTERM, which the worker may
    ignore once streaming is imported, and `terminate()` then waits for it forever. The child
    sends its answer down a pipe and exits on its own; one that lingers after answering is
    killed."""
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_send_streamed_counts, args=(leaves, dict(env or {}), send),
                            daemon=True)
    child.start()
    send.close()
    try:
        answer = receive.recv()
    except EOFError:
        child.join()
        raise RuntimeError("the StreamingDataset check process died before answering "
                           f"(exit code {child.exitcode})") from None
    finally:
        receive.close()
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
            child.join()
    if isinstance(answer, BaseException):
        raise answer
    return answer


def _send_streamed_counts(leaves: list[str], env: dict[str, str], send) -> None:
    os.environ.update(env)
    try:
        answer: object = _streamed_counts(leaves)
    except BaseException as exc:  # sent back and raised in the caller, with its message
        answer = exc
    send.send(answer)
    send.close()


def _streamed_counts(leaves: list[str]) -> list[int]:
    from streaming import Stream, StreamingDataset

    with tempfile.TemporaryDirectory(prefix="prx-mds-check-") as cache:
        streams = [Stream(remote=leaf, local=f"{cache}/{n}") if object_store.is_object_store(leaf)
                   else Stream(local=leaf) for n, leaf in enumerate(leaves)]
        dataset = StreamingDataset(streams=streams, batch_size=1, shuffle=False)
        return [int(n) for n in dataset.samples_per_stream]
