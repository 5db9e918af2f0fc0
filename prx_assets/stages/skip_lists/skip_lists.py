"""Skip lists: per-shard sidecars that tell the loader which samples to leave out.

Beside each shard `shard.NNNNN.mds` of an MDS leaf sits `shard.NNNNN.skip.json`:

    {"version": 1, "lists": {"<reason>": [sorted shard-local sample indices], ...}}

An absent sidecar means nothing is skipped. Reasons are `dedup`, `text`, `nsfw` (and any
other caption label chosen), `optout`, and one per named ablation list. Shards are never
touched: changing what is skipped costs one small file per shard, not a rewrite.

Each sidecar is replaced atomically (temporary file in the same folder, then
`os.replace`), so a reader sees the old list or the new one, never half a file. A crash
part-way leaves some shards on the old lists and some on the new, each a valid state; a
rerun converges.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

import lance
import pyarrow as pa
import pyarrow.compute as pc

from prx_assets.engine.failpoints import failpoint
from prx_assets.stages.shards.trees import TREE_MANIFEST, leaf_names, new_tree_version, tree_store
from prx_assets.storage import object_store
from prx_assets.storage.lance_tables import open_table, table_exists
from prx_assets.storage.filters import all_of, eq_filter, in_filter, sql_string

SIDECAR_VERSION = 1
SHARD_SUFFIX = ".mds"
SIDECAR_SUFFIX = ".skip.json"
REASON_DEDUP, REASON_OPTOUT = "dedup", "optout"
# Samples an incremental mds_shards run superseded (the id changed or left the source): still
# stored in an older shard, written by mds_shards itself, always applied by the loader and
# kept by the skip_lists asset whatever it is configured with; a rewrite drops them.
REASON_STALE = "stale"
ABLATION_NAME = re.compile(r"^[a-z0-9_]+$")
# An ablation list is its own reason, so it cannot take a built-in reason's name.
RESERVED_REASONS = frozenset({"dedup", "optout", "text", "nsfw", "visual", REASON_STALE})
# Columns of the MDS mapping table (`mds_samples`) a skip list needs.
MAPPING_COLUMNS = ["id", "leaf", "shard", "sample_index"]

ShardKey = tuple[str, str]  # (leaf relative to the source's tree, shard file name)
SkipLists = dict[ShardKey, dict[str, list[int]]]


def sidecar_path(shard_path: str | Path) -> Path:
    """`.../shard.00003.mds` -> `.../shard.00003.skip.json`."""
    shard_path = Path(shard_path)
    return shard_path.with_name(shard_path.name.removesuffix(SHARD_SUFFIX) + SIDECAR_SUFFIX)


def sidecar_uri(shard_uri: str) -> str:
    """`sidecar_path` for a URI string (`s3://...` must not go through pathlib)."""
    return shard_uri.removesuffix(SHARD_SUFFIX) + SIDECAR_SUFFIX


def read_sidecar(path: str | Path, storage_options: Mapping[str, str] | None = None
                 ) -> dict[str, list[int]]:
    """The skip lists of one shard by reason; {} when the sidecar does not exist.
    `path` may be an `s3://` URI (read with the root's settings). (The training loader reads
    sidecars through this function.)"""
    try:
        if object_store.is_object_store(path):
            text = object_store.read_text(object_store.as_uri(path), storage_options)
        else:
            text = Path(path).read_text()
        data = json.loads(text)
    except FileNotFoundError:
        return {}
    if data.get("version") != SIDECAR_VERSION:
        raise ValueError(f"{path}: unsupported skip sidecar version {data.get('version')!r}")
    return {str(reason): [int(i) for i in indices] for reason, indices in data["lists"].items()}


def sidecar_body(lists: Mapping[str, Iterable[int]]) -> str | None:
    """A sidecar's JSON text, None when nothing is skipped (no sidecar at all)."""
    clean = {reason: sorted({int(i) for i in ids}) for reason, ids in sorted(lists.items())}
    clean = {reason: ids for reason, ids in clean.items() if ids}
    if not clean:
        return None
    return json.dumps({"version": SIDECAR_VERSION, "lists": clean}, separators=(",", ":"))


def write_sidecar(path: Path, lists: Mapping[str, Iterable[int]]) -> None:
    """Atomically replace the sidecar; empty lists remove it (absent = nothing skipped)."""
    path = Path(path)
    body = sidecar_body(lists)
    if body is None:
        path.unlink(missing_ok=True)
        return
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(body)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def skipped_indices(lists: Mapping[str, list[int]], reasons: Iterable[str] | None = None
                    ) -> set[int]:
    """The union of the selected reasons (all of them by default): what the loader skips."""
    chosen = lists if reasons is None else {r: lists.get(r, []) for r in reasons}
    return {i for ids in chosen.values() for i in ids}


def read_ablations(directory: Path | str,
                   storage_options: Mapping[str, str] | None = None) -> dict[str, set[str]]:
    """Named ablation lists: `<directory>/<name>.txt`, one id per line, `#` comments. The
    folder may be an `s3://` prefix (listed and read with the root's settings)."""
    lists: dict[str, set[str]] = {}
    for uri in object_store.list_files(object_store.as_uri(directory), ".txt", storage_options):
        name = uri.rsplit("/", 1)[1].removesuffix(".txt")
        if not ABLATION_NAME.match(name):
            raise ValueError(f"{uri}: ablation name {name!r} must match [a-z0-9_]+")
        if name in RESERVED_REASONS:
            raise ValueError(f"{uri}: ablation name {name!r} is a built-in reason")
        text = object_store.read_text(uri, storage_options)
        lines = (line.split("#", 1)[0].strip() for line in text.splitlines())
        lists[name] = {line for line in lines if line}
    return lists


def build_skip_lists(mapping: Iterable[pa.RecordBatch], reasons: Mapping[str, set[str]]
                     ) -> SkipLists:
    """Shard-local indices per shard and reason, from the MDS mapping table's batches
    (columns MAPPING_COLUMNS) and the ids each reason removes."""
    value_sets = {reason: pa.array(sorted(ids), pa.string())
                  for reason, ids in reasons.items() if ids}
    lists: SkipLists = {}
    for batch in mapping:
        ids = batch.column("id")
        for reason, values in value_sets.items():
            rows = batch.filter(pc.fill_null(pc.is_in(ids, value_set=values), False))
            for leaf, shard, index in zip(rows.column("leaf").to_pylist(),
                                          rows.column("shard").to_pylist(),
                                          rows.column("sample_index").to_pylist()):
                lists.setdefault((leaf, shard), {}).setdefault(reason, []).append(int(index))
    return {key: {r: sorted(set(v)) for r, v in by_reason.items()}
            for key, by_reason in lists.items()}


@dataclass
class ApplyReport:
    written: int = 0
    removed: int = 0
    unchanged: int = 0
    shards: int = 0
    skipped_per_reason: Counter = field(default_factory=Counter)
    skipped_total: int = 0
    skipped_per_leaf: dict[str, int] = field(default_factory=dict)
    # Samples skipped now and not before, or the other way round (any reason counts once).
    samples_changed: int = 0

    def count_change(self, old: Mapping[str, list[int]], new: Mapping[str, list[int]]) -> None:
        self.samples_changed += len(skipped_indices(old) ^ skipped_indices(new))


def apply_skip_lists(tree: Path, lists: SkipLists, shards: Iterable[ShardKey]) -> ApplyReport:
    """Write every shard's sidecar under the local `tree` (the source's current MDS tree),
    in place; shards not in `lists` lose their other reasons. `stale` lists (mds_shards'
    own) are kept as they are. Unchanged sidecars are not rewritten."""
    tree = Path(tree)
    on_disk = {(str(p.parent.relative_to(tree)), p.name.removesuffix(SIDECAR_SUFFIX) + SHARD_SUFFIX)
               for p in sidecar_files(tree)}
    report = ApplyReport()
    final: SkipLists = {}
    for leaf, shard in sorted(set(shards) | set(lists) | on_disk):
        report.shards += 1
        path = sidecar_path(tree / leaf / shard)
        old = read_sidecar(path)
        new = with_stale_of(old, lists.get((leaf, shard), {}))
        final[(leaf, shard)] = new
        report.count_change(old, new)
        if old == new:
            report.unchanged += 1
            continue
        write_sidecar(path, new)
        failpoint("skip_lists.sidecar_written")
        if new:
            report.written += 1
        else:
            report.removed += 1
    return _count_skipped(report, final)


def with_stale_of(old: Mapping[str, list[int]], new: Mapping[str, list[int]]
                  ) -> dict[str, list[int]]:
    """`new` plus the `stale` list of `old` (only mds_shards decides what is stale)."""
    lists = {reason: ids for reason, ids in new.items() if reason != REASON_STALE and ids}
    if old.get(REASON_STALE):
        lists[REASON_STALE] = old[REASON_STALE]
    return lists


def _count_skipped(report: ApplyReport, final: SkipLists) -> ApplyReport:
    for (leaf, _), by_reason in final.items():
        for reason, ids in by_reason.items():
            report.skipped_per_reason[reason] += len(ids)
        report.skipped_per_leaf[leaf] = (report.skipped_per_leaf.get(leaf, 0)
                                         + len(skipped_indices(by_reason)))
    report.skipped_total = sum(report.skipped_per_leaf.values())
    return report


def publish_skip_lists(storage, source: str, lists: SkipLists, shards: Iterable[ShardKey]
                       ) -> ApplyReport:
    """Apply `lists` to `source`'s current tree. Locally the sidecars are replaced in place
    (each atomically). On an object store a new tree version is made: every shard and index
    server-side copied into it, a new sidecar set written, the pointer moved last, so a
    reader holding the old pointer still reads the old version whole."""
    store = tree_store(storage, source)
    if store.is_local:
        return apply_skip_lists(Path(store.current_tree()), lists, shards)
    current = store.current_version()
    old_tree = store.current_tree()
    version = new_tree_version()
    staging = store.staging_uri(version)
    report = ApplyReport()
    final: SkipLists = {}
    options = store.storage_options
    try:
        for leaf in leaf_names(store, old_tree):
            names = object_store.list_files(f"{old_tree}/{leaf}", "", options)
            store.carry_many([(uri, f"{staging}/{leaf}/{uri.rsplit('/', 1)[1]}")
                              for uri in names if not uri.endswith(SIDECAR_SUFFIX)])
            old_sidecars = {uri.rsplit("/", 1)[1] for uri in names if uri.endswith(SIDECAR_SUFFIX)}
            leaf_shards = {shard for l, shard in set(shards) | set(lists) if l == leaf}
            leaf_shards |= {n.removesuffix(SIDECAR_SUFFIX) + SHARD_SUFFIX for n in old_sidecars}
            for shard in sorted(leaf_shards):
                report.shards += 1
                name = shard.removesuffix(SHARD_SUFFIX) + SIDECAR_SUFFIX
                old = (read_sidecar(f"{old_tree}/{leaf}/{name}", options)
                       if name in old_sidecars else {})
                new = with_stale_of(old, lists.get((leaf, shard), {}))
                final[(leaf, shard)] = new
                report.count_change(old, new)
                body = sidecar_body(new)
                if body is not None:
                    store.write_text(f"{staging}/{leaf}/{name}", body)
                    failpoint("skip_lists.sidecar_staged")
                if old == new:
                    report.unchanged += 1
                elif new:
                    report.written += 1
                else:
                    report.removed += 1
        manifest = json.loads(store.read_text(f"{old_tree}/{TREE_MANIFEST}"))
        # Same shards as the parent (whose version wrote them): the mapping stays right.
        manifest.update(tree_version=version, parent=current, commits_mapping=False,
                        mapping_base_version=None,
                        shards_of=manifest.get("shards_of", current))
        store.write_text(f"{staging}/{TREE_MANIFEST}", json.dumps(manifest, indent=2,
                                                                   sort_keys=True))
    except BaseException:
        store.delete_tree(staging)
        raise
    store.publish(version)
    store.prune(int(manifest.get("keep_trees", 2)))
    return _count_skipped(report, final)


def mapping_batches(uri: Path | str, batch_rows: int = 1 << 18,
                    storage_options: Mapping[str, str] | None = None
                    ) -> Iterable[pa.RecordBatch]:
    return lance.dataset(str(uri), storage_options=storage_options).scanner(
        columns=MAPPING_COLUMNS, batch_size=batch_rows).to_batches()


def mapping_shards(uri: Path | str, batch_rows: int = 1 << 18,
                   storage_options: Mapping[str, str] | None = None
                   ) -> tuple[set[ShardKey], dict[str, int]]:
    """Every shard of the mapping table, and samples per leaf (one stream each)."""
    shards: set[ShardKey] = set()
    per_leaf: Counter = Counter()
    for batch in lance.dataset(str(uri), storage_options=storage_options).scanner(
            columns=["leaf", "shard"], batch_size=batch_rows).to_batches():
        pairs = pa.table({"leaf": batch.column("leaf"), "shard": batch.column("shard")})
        counts = pairs.group_by(["leaf", "shard"]).aggregate([([], "count_all")])
        for leaf, shard, n in zip(counts.column("leaf").to_pylist(),
                                  counts.column("shard").to_pylist(),
                                  counts.column("count_all").to_pylist()):
            shards.add((leaf, shard))
            per_leaf[leaf] += n
    return shards, dict(per_leaf)


def sidecar_files(tree: Path) -> list[Path]:
    return sorted(Path(tree).rglob(f"*{SIDECAR_SUFFIX}"))


def tree_sidecars(tree: str, storage_options: Mapping[str, str] | None = None) -> list[str]:
    """Every sidecar of a tree (local folder or s3:// prefix), as sorted locations."""
    if not object_store.is_object_store(tree):
        return [str(p) for p in sidecar_files(Path(tree))]
    import pyarrow.fs as pafs

    fs, path = object_store.filesystem(tree, storage_options)
    infos = fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True))
    base = tree.rstrip("/")
    return sorted(f"{base}/{info.path[len(path) + 1:]}" for info in infos
                  if info.type == pafs.FileType.File and info.base_name.endswith(SIDECAR_SUFFIX))


def duplicate_ids(duplicates_uri: Path | str, source: str, batch_rows: int = 1 << 18,
                  storage_options: Mapping[str, str] | None = None) -> set[str]:
    """The source's non-kept copies (the kept copy of a group is listed with id == kept_id)."""
    if not table_exists(duplicates_uri, storage_options):
        return set()
    scanner = open_table(duplicates_uri, storage_options=storage_options).scanner(
        columns=["id"], batch_size=batch_rows,
        filter=f"id != kept_id AND starts_with(id, {sql_string(source + ':')})")
    return {i for batch in scanner.to_batches() for i in batch.column("id").to_pylist()}


def label_ids(labels_uri: Path | str, labels: Iterable[str], caption_version: str,
              classifier_version: str, batch_rows: int = 1 << 18,
              storage_options: Mapping[str, str] | None = None) -> dict[str, set[str]]:
    """Ids per chosen label, from the active caption and classifier versions only."""
    labels = sorted(set(labels))
    found: dict[str, set[str]] = {label: set() for label in labels}
    if not labels or not table_exists(labels_uri, storage_options):
        return found
    condition = all_of(eq_filter("caption_version", caption_version),
                       eq_filter("classifier_version", classifier_version),
                       in_filter("label", labels))
    scanner = open_table(labels_uri, storage_options=storage_options).scanner(
        columns=["id", "label"], filter=condition, batch_size=batch_rows)
    for batch in scanner.to_batches():
        for sample_id, label in zip(batch.column("id").to_pylist(),
                                    batch.column("label").to_pylist()):
            found[label].add(sample_id)
    return found


def skip_shares(tree: Path | str, per_leaf: Mapping[str, int],
                storage_options: Mapping[str, str] | None = None) -> dict[str, tuple[int, int]]:
    """(stored samples, skipped) per stream (leaf), read back from the tree's sidecars;
    `per_leaf` is the mapping table's live samples per leaf. Stale samples are stored and
    read past but not in the mapping: they count as stored and as skipped."""
    tree = str(tree)
    skipped: Counter = Counter()
    stale: Counter = Counter()
    for path in tree_sidecars(tree, storage_options):
        leaf = path[len(tree) + 1:].rsplit("/", 1)[0]
        lists = read_sidecar(path, storage_options)
        skipped[leaf] += len(skipped_indices(lists))
        stale[leaf] += len(lists.get(REASON_STALE, []))
    leaves = sorted(set(per_leaf) | set(stale))
    return {leaf: (per_leaf.get(leaf, 0) + stale[leaf], skipped.get(leaf, 0)) for leaf in leaves}


def skipped_ids(tree: Path | str, mapping_uri: Path | str, reasons: Iterable[str] | None = None,
                batch_rows: int = 1 << 18, storage_options: Mapping[str, str] | None = None
                ) -> set[str]:
    """The live ids a tree's sidecars skip (for the selected reasons; all by default)."""
    from prx_assets.storage.object_store import lance_options

    wanted = None if reasons is None else list(reasons)
    per_shard: dict[ShardKey, set[int]] = {}
    found: set[str] = set()
    for batch in mapping_batches(mapping_uri, batch_rows,
                                 lance_options(str(mapping_uri), storage_options)):
        for sample_id, leaf, shard, index in zip(
                batch.column("id").to_pylist(), batch.column("leaf").to_pylist(),
                batch.column("shard").to_pylist(), batch.column("sample_index").to_pylist()):
            if (leaf, shard) not in per_shard:
                lists = read_sidecar(sidecar_uri(f"{tree}/{leaf}/{shard}"), storage_options)
                per_shard[(leaf, shard)] = skipped_indices(lists, wanted)
            if index in per_shard[(leaf, shard)]:
                found.add(sample_id)
    return found


def reasons_in(tree: Path | str, storage_options: Mapping[str, str] | None = None) -> set[str]:
    return {reason for path in tree_sidecars(str(tree), storage_options)
            for reason in read_sidecar(path, storage_options)}
