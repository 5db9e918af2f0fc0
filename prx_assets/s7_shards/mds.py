"""Mosaic Data Shards: the per-source tree the trainer streams, written from Lance.

Layout (see docs/mds.md):

    $PRX_DATA_ROOT/mds/<source>                -> .trees/<source>/<tree_version>  (symlink)
    $PRX_DATA_ROOT/mds/.trees/<source>/<tree_version>/<tier>/<W>x<H>/index.json + shard.NNNNN.mds

A build happens in `<tree_version>.partial/`, is renamed to `<tree_version>/` when complete,
and becomes current by replacing the `mds/<source>` symlink with `os.replace` (atomic): a
reader resolves the link once and sees one whole tree; a killed run leaves the previous tree
current. The mapping table `lance/mds_samples/<source>.lance` says where every id landed.

Writing: the driver plans from metadata only (ids, shapes, Lance row ids, no image bytes),
sorts each leaf by id and cuts it into parts of fixed row counts; Ray tasks fetch their rows
by row id from Lance and write each part with mosaicml-streaming's `MDSWriter`; the driver
renames the parts' shards into one sequence per leaf and merges their indexes. Same inputs,
same options: byte-identical shards.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import shutil
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray
from streaming import MDSWriter

from prx_assets.engine.failpoints import failpoint
from prx_assets.storage.lance_tables import prepare_output_dir, table_exists
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

MDS_SAMPLES_SCHEMA = pa.schema([
    pa.field("id", pa.string(), nullable=False),
    pa.field("source", pa.string(), nullable=False),
    pa.field("tier", pa.int32(), nullable=False),
    pa.field("width", pa.int32(), nullable=False),
    pa.field("height", pa.int32(), nullable=False),
    pa.field("leaf", pa.string(), nullable=False),  # relative to mds/<source>, e.g. 512/512x512
    pa.field("shard", pa.string(), nullable=False),  # e.g. shard.00000.mds
    pa.field("sample_index", pa.int64(), nullable=False),  # shard-local
    pa.field("tree_version", pa.string(), nullable=False),
])

DEFAULT_SIZE_LIMIT = 128 << 20  # ~128 MB shards, the design's size
DEFAULT_ROWS_PER_PART = 50_000  # one Ray task per part: ~5-20 GB of JPEGs, a few dozen shards
TAKE_ROWS = 64  # rows fetched from Lance per read inside a task (bounded memory)
MDS_DIR = "mds"
TREES_DIR = ".trees"
PARTIAL_SUFFIX = ".partial"
TREE_MANIFEST = "tree.json"


@dataclass(frozen=True)
class SampleInputs:
    """Where a source's samples come from: kept bucketed rows joined with usable captions."""

    bucketed_uri: str
    captions_uri: str
    caption_filter: str  # Lance SQL selecting the active, usable caption rows
    bucketed_version: int | None = None
    captions_version: int | None = None
    exclude_ids: frozenset[str] = frozenset()  # e.g. a rewrite without skipped samples


@dataclass(frozen=True)
class WriteOptions:
    size_limit: int = DEFAULT_SIZE_LIMIT
    compression: str | None = None  # JPEG bytes do not compress further
    rows_per_part: int = DEFAULT_ROWS_PER_PART
    keep_trees: int = 2  # the current tree and the one before (a trainer may still read it)
    parallel: bool = True  # Ray tasks; False writes the parts in this process (tiny sources)


@dataclass(frozen=True)
class LeafReport:
    tier: int
    width: int
    height: int
    samples: int
    shards: int
    bytes: int

    @property
    def name(self) -> str:
        return leaf_name(self.tier, self.width, self.height)


@dataclass
class TreeReport:
    source: str
    tree_version: str
    path: Path
    mapping_uri: Path
    mapping_version: int
    left_out: Counter = field(default_factory=Counter)
    leaves: list[LeafReport] = field(default_factory=list)

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

    out: Path
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
    """The source's current tree, resolved once (a later swap does not move what you hold).

    `root` is the MDS root (`$PRX_DATA_ROOT/mds`); the data root above it is accepted too.
    """
    link = _as_mds_root(root, source) / source
    if not link.exists():
        raise FileNotFoundError(f"no MDS tree for source {source!r} at {link}; "
                                "materialise mds_shards first")
    return link.resolve()


def tree_leaves(tree: Path, tier: int | None = None) -> list[Path]:
    """Leaf folders (those holding index.json) of a tree, optionally of one tier, sorted."""
    pattern = f"{tier}/*/index.json" if tier is not None else "*/*/index.json"
    return sorted(p.parent for p in Path(tree).glob(pattern))


def leaf_samples(leaf: Path) -> int:
    index = json.loads((Path(leaf) / "index.json").read_text())
    return sum(shard["samples"] for shard in index["shards"])


# ---------------------------------------------------------------------------------- planning

def plan_samples(inputs: SampleInputs) -> tuple[pa.Table, Counter]:
    """Kept rows with a usable caption, sorted by (tier, width, height, id), plus the rows
    left out by reason. Reads ids, shapes and row ids only: no image bytes, no caption text."""
    bucketed = lance.dataset(inputs.bucketed_uri, version=inputs.bucketed_version)
    kept = bucketed.to_table(columns=["id", "tier", "width", "height"], filter="status = 'ok'",
                             with_row_id=True)
    kept = kept.rename_columns(["id", "tier", "width", "height", "image_row"])
    captions = lance.dataset(inputs.captions_uri, version=inputs.captions_version)
    usable = captions.to_table(columns=["id"], filter=inputs.caption_filter, with_row_id=True)
    # Several usable rows for one id should not happen; take the first written, deterministically.
    usable = usable.group_by("id").aggregate([("_rowid", "min")]).rename_columns(
        ["id", "caption_row"])
    joined = kept.join(usable, "id", join_type="left outer")
    left_out: Counter = Counter()
    if inputs.exclude_ids:
        excluded = pc.is_in(joined["id"], value_set=pa.array(sorted(inputs.exclude_ids)))
        left_out["excluded"] = pc.sum(excluded).as_py() or 0
        joined = joined.filter(pc.invert(excluded))
    missing = pc.is_null(joined["caption_row"])
    left_out["no_caption"] = pc.sum(missing).as_py() or 0
    joined = joined.filter(pc.invert(missing))
    order = [("tier", "ascending"), ("width", "ascending"), ("height", "ascending"),
             ("id", "ascending")]
    return joined.sort_by(order), +left_out


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


def part_specs(leaf_rows: pa.Table, leaf_dir: Path, rows_per_part: int) -> list[PartSpec]:
    specs = []
    for n, start in enumerate(range(0, leaf_rows.num_rows, rows_per_part)):
        rows = leaf_rows.slice(start, rows_per_part)
        specs.append(PartSpec(
            out=leaf_dir / f"part.{n:05d}", ids=rows["id"].to_pylist(),
            image_rows=rows["image_row"].to_numpy(), caption_rows=rows["caption_row"].to_numpy()))
    return specs


# ---------------------------------------------------------------------------------- writing

def write_part(spec: PartSpec, inputs: SampleInputs, options: WriteOptions) -> list[dict]:
    """Write one part with MDSWriter (runs in a Ray task); returns its index's shard entries."""
    bucketed = lance.dataset(inputs.bucketed_uri, version=inputs.bucketed_version)
    captions = lance.dataset(inputs.captions_uri, version=inputs.captions_version)
    with MDSWriter(columns=MDS_COLUMNS, out=str(spec.out), size_limit=options.size_limit,
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
    return json.loads((spec.out / "index.json").read_text())["shards"]


def _rows_by_id(table: pa.Table) -> dict[str, dict]:
    return {row["id"]: row for row in table.to_pylist()}


def _sample(row: dict, caption: str) -> dict:
    return {"image": bytes(row["image"]), "caption": caption, "id": row["id"],
            "source": row["source"], "width": int(row["width"]), "height": int(row["height"]),
            "original_width": int(row["original_width"]),
            "original_height": int(row["original_height"])}


def run_parts(specs: list[PartSpec], inputs: SampleInputs, options: WriteOptions,
              log: Callable[[str], None]) -> list[list[dict]]:
    """All parts as Ray tasks; results in the order of `specs`; progress logged as they end."""
    if not options.parallel:
        return [write_part(spec, inputs, options) for spec in specs]
    inputs_ref, options_ref = ray.put(inputs), ray.put(options)
    groups = task_groups(specs, options.rows_per_part)
    refs = [_write_parts_task.remote(group, inputs_ref, options_ref) for group in groups]
    pending, done = list(refs), 0
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        ray.get(ready)  # surface a failed task now
        done += 1
        if done == len(refs) or done % max(1, len(refs) // 10) == 0:
            log(f"MDS tasks done: {done}/{len(refs)} ({len(specs)} parts)")
    return [entries for group in ray.get(refs) for entries in group]


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


def merge_leaf(leaf_dir: Path, parts: list[tuple[PartSpec, list[dict]]]) -> list[dict]:
    """Move every part's shards into `leaf_dir` as one sequence and write the leaf's index.

    (streaming's `merge_index` keeps each part in its own subfolder; renaming keeps the flat
    `shard.NNNNN.mds` layout that skip-list sidecars sit beside.)"""
    shards: list[dict] = []
    for spec, entries in parts:
        for entry in entries:
            number = len(shards)
            entry = json.loads(json.dumps(entry))  # a private copy to rename in
            for kind in ("raw_data", "zip_data"):
                info = entry.get(kind)
                if info:
                    old = spec.out / info["basename"]
                    info["basename"] = f"shard.{number:05d}.mds" + info["basename"].split(".mds", 1)[1]
                    if old.exists():
                        os.replace(old, leaf_dir / info["basename"])
            shards.append(entry)
        shutil.rmtree(spec.out)
    with open(leaf_dir / "index.json", "w") as out:
        json.dump({"version": 2, "shards": shards}, out, sort_keys=True)
    return shards


def mapping_rows(source: str, key: tuple[int, int, int], leaf_rows: pa.Table,
                 shards: list[dict], tree_version: str) -> pa.Table:
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
    }, schema=MDS_SAMPLES_SCHEMA)


def new_tree_version() -> str:
    """Sortable and unique per build: UTC time to the microsecond."""
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")


def write_mds_tree(inputs: SampleInputs, storage: Storage | str | Path, source: str,
                   options: WriteOptions = WriteOptions(),
                   log: Callable[[str], None] = logger.info) -> TreeReport:
    """Build `mds/<source>` from `inputs` aside, record the mapping table, swap it in."""
    storage = as_storage(storage)
    plan, left_out = plan_samples(inputs)
    log(f"{source}: {plan.num_rows:,} samples to write; left out {dict(left_out) or 'none'}")
    trees = Path(storage.mds_root) / TREES_DIR / source
    mapping_uri = storage.table(MDS_SAMPLES, source)
    prepare_output_dir(trees, "MDS trees")
    prepare_output_dir(Path(mapping_uri), "Lance table")
    remove_partial_builds(trees)
    version = new_tree_version()
    staging = trees / (version + PARTIAL_SUFFIX)
    try:
        leaves, mapping = _build_tree(plan, staging, source, version, inputs, options, log)
        (staging / TREE_MANIFEST).write_text(json.dumps(
            {"source": source, "tree_version": version, "samples": plan.num_rows,
             "bucketed_version": inputs.bucketed_version,
             "captions_version": inputs.captions_version}, indent=2, sort_keys=True))
        final = trees / version
        os.rename(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    mapping_version = write_mapping(mapping, mapping_uri)
    swap_current(Path(storage.mds_tree(source)), final)
    prune_trees(trees, options.keep_trees)
    log(f"{source}: tree {version} is current ({sum(l.samples for l in leaves):,} samples, "
        f"{sum(l.shards for l in leaves)} shards)")
    return TreeReport(source=source, tree_version=version, path=final, mapping_uri=mapping_uri,
                      mapping_version=mapping_version, left_out=left_out, leaves=leaves)


def _build_tree(plan: pa.Table, staging: Path, source: str, version: str,
                inputs: SampleInputs, options: WriteOptions, log: Callable[[str], None]
                ) -> tuple[list[LeafReport], pa.Table]:
    leaves = split_leaves(plan)
    specs_per_leaf = [part_specs(rows, staging / leaf_name(*key), options.rows_per_part)
                      for key, rows in leaves]
    flat = [spec for specs in specs_per_leaf for spec in specs]
    log(f"{source}: {len(leaves)} leaves, {len(flat)} parts")
    results = iter(run_parts(flat, inputs, options, log))
    reports, tables = [], []
    for (key, rows), specs in zip(leaves, specs_per_leaf):
        leaf_dir = staging / leaf_name(*key)
        shards = merge_leaf(leaf_dir, [(spec, next(results)) for spec in specs])
        tables.append(mapping_rows(source, key, rows, shards, version))
        size = sum(entry["raw_data"]["bytes"] for entry in shards)
        reports.append(LeafReport(*key, samples=rows.num_rows, shards=len(shards), bytes=size))
    staging.mkdir(parents=True, exist_ok=True)  # an empty source still gets an (empty) tree
    mapping = pa.concat_tables(tables) if tables else MDS_SAMPLES_SCHEMA.empty_table()
    return reports, mapping


def write_mapping(mapping: pa.Table, uri: Path) -> int:
    """One overwrite commit: readers see the previous mapping or this one, never a mix."""
    prepare_output_dir(uri, "Lance table")
    mode = "overwrite" if table_exists(uri) else "create"
    return lance.write_dataset(mapping, str(uri), schema=MDS_SAMPLES_SCHEMA, mode=mode).version


def swap_current(link: Path, target: Path) -> None:
    """Point `link` at `target` atomically (a relative symlink, replaced with os.replace)."""
    if link.exists() and not link.is_symlink():
        raise RuntimeError(f"{link} is a real folder, not the tree symlink; move it away first")
    temporary = link.with_name(f".{link.name}.{target.name}.link")
    if os.path.lexists(temporary):
        temporary.unlink()
    os.symlink(os.path.relpath(target, link.parent), temporary)
    os.replace(temporary, link)


def remove_partial_builds(trees: Path) -> None:
    """Leftovers of killed builds (never current, never read)."""
    for partial in trees.glob("*" + PARTIAL_SUFFIX):
        shutil.rmtree(partial, ignore_errors=True)


def prune_trees(trees: Path, keep: int) -> None:
    builds = sorted(p for p in trees.iterdir()
                    if p.is_dir() and not p.name.endswith(PARTIAL_SUFFIX))
    for old in builds[:-max(1, keep)]:
        shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------------------- checking

@dataclass(frozen=True)
class LeafCheck:
    leaf: str
    streamed: int  # samples a plain StreamingDataset sees
    mapped: int  # rows of the mapping table for this leaf

    @property
    def ok(self) -> bool:
        return self.streamed == self.mapped


def verify_tree(storage: Storage | str | Path, source: str) -> tuple[list[LeafCheck], list[str]]:
    """Open every leaf of the current tree with `streaming.StreamingDataset` and compare its
    sample count with the mapping table; also report mapping rows of another tree version."""
    storage = as_storage(storage)
    tree = current_tree(Path(storage.mds_root), source)
    mapping = storage.open(MDS_SAMPLES, source).to_table(
        columns=["leaf", "tree_version"])
    problems = sorted({f"mapping rows of tree {v}, current is {tree.name}"
                       for v in pc.unique(mapping["tree_version"]).to_pylist() if v != tree.name})
    mapped = Counter(mapping["leaf"].to_pylist())
    leaves = tree_leaves(tree)
    streamed = streamed_counts([str(leaf) for leaf in leaves]) if leaves else []
    checks = []
    for leaf, count in zip(leaves, streamed):
        name = str(leaf.relative_to(tree))
        checks.append(LeafCheck(name, count, mapped.pop(name, 0)))
    checks += [LeafCheck(name, 0, n) for name, n in sorted(mapped.items())]  # no such leaf
    return checks, problems


def streamed_counts(leaves: list[str]) -> list[int]:
    """Samples per leaf as one plain StreamingDataset (a stream per leaf) sees them.

    Runs in a spawned process: every StreamingDataset registers shared-memory objects that
    later datasets in the same process keep open (thousands of descriptors after a few dozen
    leaves), so a long-lived process such as a Dagster run must not create them itself.

    A Pool is not used: leaving it terminates its worker with SIGTERM, which the worker may
    ignore once streaming is imported, and `terminate()` then waits for it forever. The child
    sends its answer down a pipe and exits on its own; one that lingers after answering is
    killed."""
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_send_streamed_counts, args=(leaves, send), daemon=True)
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


def _send_streamed_counts(leaves: list[str], send) -> None:
    try:
        answer: object = _streamed_counts(leaves)
    except BaseException as exc:  # sent back and raised in the caller, with its message
        answer = exc
    send.send(answer)
    send.close()


def _streamed_counts(leaves: list[str]) -> list[int]:
    from streaming import Stream, StreamingDataset

    dataset = StreamingDataset(streams=[Stream(local=leaf) for leaf in leaves], batch_size=1,
                               shuffle=False)
    return [int(n) for n in dataset.samples_per_stream]
