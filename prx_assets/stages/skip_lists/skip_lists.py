"""Skip lists: which samples of each shard the loader leaves out, by reason, written as the
shard's sidecar (the format: `prx_assets/storage/sidecars.py`).

The lists are built from the MDS mapping table (`mds_samples`: id -> leaf, shard, sample
index) and the ids each reason removes. Shards are never touched: changing what is skipped
costs one small file per shard, not a rewrite.

Locally each sidecar is replaced atomically in the current tree. A crash part-way leaves
some shards on the old lists and some on the new, each a valid state; a rerun converges.
On an object store a change of lists is a new tree version with its own sidecar set
(`publish_skip_lists`).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path, PurePath

import pyarrow as pa
import pyarrow.compute as pc

from prx_assets.storage.failpoints import failpoint
from prx_assets.storage.filters import all_of, eq_filter, in_filter, sql_string
from prx_assets.storage.layout import Storage
from prx_assets.storage.leases import Lease, tree_lease
from prx_assets.storage.refs import Location, TableRef, as_location
from prx_assets.storage.sidecars import (
    DEFAULT_REASONS,
    REASON_BALANCE,
    REASON_STALE,
    SIDECAR_SUFFIX,
    applies_by_default,
    by_default,
    read_sidecar,
    shard_name_of,
    sidecar_body,
    sidecar_files,
    sidecar_name,
    sidecar_path,
    skipped_indices,
    tree_sidecars,
    write_sidecar,
)
from prx_assets.storage.tables import MDS_SAMPLES
from prx_assets.storage.trees import (
    DEFAULT_RETENTION,
    TREE_MANIFEST,
    TreeStore,
    leaf_names,
    new_tree_version,
    tree_store,
)

ABLATION_NAME = re.compile(r"^[a-z0-9_]+$")
# An ablation list is its own reason, so it cannot take a built-in reason's name.
RESERVED_REASONS = DEFAULT_REASONS | {REASON_BALANCE}
# Columns of the MDS mapping table (`mds_samples`) a skip list needs.
MAPPING_COLUMNS = ["id", "leaf", "shard", "sample_index"]
SCAN_ROWS = 1 << 18  # rows per batch when scanning a table for ids

ShardKey = tuple[str, str]  # (leaf relative to the source's tree, shard file name)
SkipLists = dict[ShardKey, dict[str, list[int]]]


def read_ablations(directory: Location | str | PurePath) -> dict[str, set[str]]:
    """Named ablation lists: `<directory>/<name>.txt`, one id per line, `#` comments. The
    folder may be an `s3://` prefix (a Location with its settings, a URI with the standard
    ones)."""
    lists: dict[str, set[str]] = {}
    for file in as_location(directory).files(".txt"):
        name = file.name.removesuffix(".txt")
        if not ABLATION_NAME.match(name):
            raise ValueError(f"{file}: ablation name {name!r} must match [a-z0-9_]+")
        if name in RESERVED_REASONS:
            raise ValueError(f"{file}: ablation name {name!r} is a built-in reason")
        lines = (line.split("#", 1)[0].strip() for line in file.read_text().splitlines())
        lists[name] = {line for line in lines if line}
    return lists


def build_skip_lists(mapping: Iterable[pa.RecordBatch],
                     reasons: Mapping[str, Collection[str] | pa.Array]) -> SkipLists:
    """Shard-local indices per shard and reason, from the MDS mapping table's batches
    (columns MAPPING_COLUMNS) and the ids each reason removes."""
    value_sets = {reason: id_values(ids) for reason, ids in reasons.items() if len(ids)}
    lists: SkipLists = {}
    for batch in mapping:
        ids = batch.column("id")
        for reason, values in value_sets.items():
            rows = batch.filter(pc.fill_null(pc.is_in(ids, value_set=values), False))
            for leaf, shard, index in zip(rows.column("leaf").to_pylist(),
                                          rows.column("shard").to_pylist(),
                                          rows.column("sample_index").to_pylist(), strict=True):
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
    skipped_total: int = 0  # samples any reason lists, opt-in ones included
    skipped_per_leaf: dict[str, int] = field(default_factory=dict)
    # Samples the loader skips when a run names no reasons (DEFAULT_REASONS), each once.
    skipped_by_default: int = 0
    # Samples skipped now and not before, or the other way round (any reason counts once).
    samples_changed: int = 0

    def count_change(self, old: Mapping[str, list[int]], new: Mapping[str, list[int]]) -> None:
        self.samples_changed += len(skipped_indices(old) ^ skipped_indices(new))

    def add(self, other: ApplyReport) -> None:
        """Count in the report of other shards (a build staging its sidecars per group)."""
        for name in ("written", "removed", "unchanged", "shards", "skipped_total",
                     "skipped_by_default", "samples_changed"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.skipped_per_reason.update(other.skipped_per_reason)
        for leaf, skipped in other.skipped_per_leaf.items():
            self.skipped_per_leaf[leaf] = self.skipped_per_leaf.get(leaf, 0) + skipped


def apply_skip_lists(tree: Path, lists: SkipLists, shards: Iterable[ShardKey]) -> ApplyReport:
    """Write every shard's sidecar under the local `tree` (the source's current MDS tree),
    in place; shards not in `lists` lose their other reasons. `stale` lists (mds_shards'
    own) are kept as they are. Unchanged sidecars are not rewritten."""
    tree = Path(tree)
    on_disk = {(str(p.parent.relative_to(tree)), shard_name_of(p.name))
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
        report.skipped_by_default += len(skipped_indices(by_default(by_reason)))
    report.skipped_total = sum(report.skipped_per_leaf.values())
    return report


def publish_skip_lists(storage: Storage, source: str, lists: SkipLists,
                       shards: Iterable[ShardKey]) -> ApplyReport:
    """Apply `lists` (built from the mapping table as it is now) to `source`'s current
    tree, holding the source's tree lease; see `apply_reasons`, which also reads the
    mapping under the lease."""
    store = tree_store(storage, source)
    with tree_lease(store.data_root, source, log=store.log) as lease:
        return _publish(store, lists, shards, lease)


@dataclass
class SkipListsRun:
    report: ApplyReport
    mapping: TableRef  # the mapping version the lists were built from (pinned)
    per_leaf: dict[str, int]  # live samples per leaf
    tree: Location  # the tree the lists were applied to (current when the run ended)


def apply_reasons(storage: Storage, source: str, reasons: Mapping[str, set[str]]
                  ) -> SkipListsRun:
    """Skip lists of `reasons` (ids per reason) applied to `source`'s current tree. The
    source's tree lease is held from reading the mapping to publishing, so no mds_shards
    build moves samples in between (the lists are shard positions) nor carries the
    sidecars while they change."""
    store = tree_store(storage, source)
    with tree_lease(store.data_root, source, log=store.log) as lease:
        mapping = storage.table(MDS_SAMPLES, source).pinned()
        shards, per_leaf = mapping_shards(mapping)
        report = _publish(store, build_skip_lists(mapping_batches(mapping), reasons), shards,
                          lease)
        return SkipListsRun(report, mapping, per_leaf, store.current_tree())


def _publish(store: TreeStore, lists: SkipLists, shards: Iterable[ShardKey], lease: Lease
             ) -> ApplyReport:
    """Locally the sidecars are replaced in place (each atomically). On an object store a
    new tree version is made: every shard and index server-side copied into it, a new
    sidecar set written, the pointer moved last by compare-and-swap, so a reader holding the
    old pointer still reads the old version whole, and old versions go only past retention
    and reader leases."""
    old_tree = store.current_tree()
    if store.is_local:
        failpoint("skip_lists.before_publish")
        lease.check()
        return apply_skip_lists(old_tree.path, lists, shards)
    return _publish_version(store, old_tree, lists, shards, lease)


def _publish_version(store: TreeStore, old_tree: Location, lists: SkipLists,
                     shards: Iterable[ShardKey], lease: Lease) -> ApplyReport:
    current = old_tree.name
    version = new_tree_version()
    staging = store.staging(version)
    report = ApplyReport()
    final: SkipLists = {}
    wanted = set(shards) | set(lists)
    try:
        for leaf in leaf_names(old_tree):
            files = (old_tree / leaf).files()
            store.carry_many([(file, staging / leaf / file.name) for file in files
                              if not file.name.endswith(SIDECAR_SUFFIX)])
            old_sidecars = {file.name for file in files if file.name.endswith(SIDECAR_SUFFIX)}
            leaf_shards = {shard for name, shard in wanted if name == leaf}
            leaf_shards |= {shard_name_of(name) for name in old_sidecars}
            for shard in sorted(leaf_shards):
                report.shards += 1
                name = sidecar_name(shard)
                old = read_sidecar(old_tree / leaf / name) if name in old_sidecars else {}
                new = with_stale_of(old, lists.get((leaf, shard), {}))
                final[(leaf, shard)] = new
                report.count_change(old, new)
                body = sidecar_body(new)
                if body is not None:
                    (staging / leaf / name).write_text(body)
                    failpoint("skip_lists.sidecar_staged")
                if old == new:
                    report.unchanged += 1
                elif new:
                    report.written += 1
                else:
                    report.removed += 1
        manifest = json.loads((old_tree / TREE_MANIFEST).read_text())
        # Same shards as the parent (whose version wrote them): the mapping stays right.
        manifest.update(tree_version=version, parent=current, commits_mapping=False,
                        mapping_base_version=None,
                        shards_of=manifest.get("shards_of", current))
        (staging / TREE_MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
    except BaseException:
        staging.delete()
        raise
    failpoint("skip_lists.before_version_publish")
    lease.check()
    store.publish(version, expected=current)
    retention = manifest.get("retention_s")
    store.prune(timedelta(seconds=float(retention)) if retention is not None
                else DEFAULT_RETENTION)
    return _count_skipped(report, final)


def stage_sidecars(staging: Location, lists: SkipLists) -> ApplyReport:
    """Write the sidecars of a version being built (a rewrite's carried reasons), so they
    publish with its shards: a published shard never lacks its sidecar."""
    report = ApplyReport()
    for (leaf, shard), by_reason in sorted(lists.items()):
        report.shards += 1
        report.count_change({}, by_reason)
        if sidecar_body(by_reason) is not None:
            write_sidecar(staging / leaf / sidecar_name(shard), by_reason)
            report.written += 1
    return _count_skipped(report, lists)


def mapping_batches(mapping: TableRef, batch_rows: int = SCAN_ROWS
                    ) -> Iterable[pa.RecordBatch]:
    return mapping.open().scanner(columns=MAPPING_COLUMNS, batch_size=batch_rows).to_batches()


def mapping_shards(mapping: TableRef, batch_rows: int = SCAN_ROWS
                   ) -> tuple[set[ShardKey], dict[str, int]]:
    """Every shard of the mapping table, and samples per leaf (one stream each)."""
    shards: set[ShardKey] = set()
    per_leaf: Counter = Counter()
    for batch in mapping.open().scanner(columns=["leaf", "shard"],
                                        batch_size=batch_rows).to_batches():
        pairs = pa.table({"leaf": batch.column("leaf"), "shard": batch.column("shard")})
        counts = pairs.group_by(["leaf", "shard"]).aggregate([([], "count_all")])
        for leaf, shard, n in zip(counts.column("leaf").to_pylist(),
                                  counts.column("shard").to_pylist(),
                                  counts.column("count_all").to_pylist(), strict=True):
            shards.add((leaf, shard))
            per_leaf[leaf] += n
    return shards, dict(per_leaf)


def _ids(table: TableRef, condition: str, batch_rows: int) -> set[str]:
    scanner = table.open().scanner(columns=["id"], filter=condition, batch_size=batch_rows)
    return {i for batch in scanner.to_batches() for i in batch.column("id").to_pylist()}


def duplicate_ids(duplicates: TableRef, source: str, batch_rows: int = SCAN_ROWS) -> set[str]:
    """The source's non-kept copies (the kept copy of a group is listed with id == kept_id)."""
    if not duplicates.exists():
        return set()
    return _ids(duplicates, f"id != kept_id AND starts_with(id, {sql_string(source + ':')})",
                batch_rows)


def semantic_duplicate_ids(semantic: TableRef, source: str, batch_rows: int = SCAN_ROWS
                           ) -> set[str]:
    """The source's non-kept copies of the semantic groups skip lists act on (`applied`)."""
    if not semantic.exists():
        return set()
    return _ids(semantic, f"applied = true AND id != kept_id AND "
                          f"starts_with(id, {sql_string(source + ':')})", batch_rows)


def unbalanced_ids(concepts: TableRef, source: str, batch_rows: int = SCAN_ROWS) -> set[str]:
    """The source's samples the balanced concept sample leaves out (one row per sample at
    level 1 of the `concepts` table)."""
    if not concepts.exists():
        return set()
    return _ids(concepts, f"level = 1 AND balanced = false AND "
                          f"starts_with(id, {sql_string(source + ':')})", batch_rows)


def label_ids(labels_table: TableRef, labels: Iterable[str], caption_version: str,
              classifier_version: str, batch_rows: int = SCAN_ROWS) -> dict[str, set[str]]:
    """Ids per chosen label, from the active caption and classifier versions only."""
    labels = sorted(set(labels))
    found: dict[str, set[str]] = {label: set() for label in labels}
    if not labels or not labels_table.exists():
        return found
    condition = all_of(eq_filter("caption_version", caption_version),
                       eq_filter("classifier_version", classifier_version),
                       in_filter("label", labels))
    scanner = labels_table.open().scanner(columns=["id", "label"], filter=condition,
                                          batch_size=batch_rows)
    for batch in scanner.to_batches():
        for sample_id, label in zip(batch.column("id").to_pylist(),
                                    batch.column("label").to_pylist(), strict=True):
            found[label].add(sample_id)
    return found


@dataclass
class SkipTally:
    """What sidecars skip, told apart as the loader tells it: `skipped` samples by default
    (each once, whatever its reasons), `by_reason` samples per default reason, and `opt_in`
    samples per opt-in list (counted, not skipped)."""

    skipped: int = 0
    by_reason: Counter = field(default_factory=Counter)
    opt_in: Counter = field(default_factory=Counter)

    def add(self, lists: Mapping[str, list[int]]) -> None:
        """Count one shard's lists in."""
        self.skipped += len(skipped_indices(by_default(lists)))
        for reason, ids in lists.items():
            (self.by_reason if applies_by_default(reason) else self.opt_in)[reason] += len(ids)


@dataclass
class StreamSkips:
    """One stream (leaf): samples stored and what its sidecars skip."""

    samples: int
    skips: SkipTally

    @property
    def share(self) -> float:
        """The share of the stream skipped by default."""
        return self.skips.skipped / self.samples if self.samples else 0.0


def skip_shares(tree: Location, per_leaf: Mapping[str, int]) -> dict[str, StreamSkips]:
    """Samples stored and skipped per stream (leaf), read back from the tree's sidecars;
    `per_leaf` is the mapping table's live samples per leaf. Stale samples are stored and
    read past but not in the mapping: they count as stored and as skipped."""
    tallies: dict[str, SkipTally] = {}
    for sidecar in tree_sidecars(tree):
        leaf = sidecar.parent.uri[len(tree.uri.rstrip("/")) + 1:]
        tallies.setdefault(leaf, SkipTally()).add(read_sidecar(sidecar))
    leaves = sorted(set(per_leaf) | set(tallies))
    return {leaf: StreamSkips(per_leaf.get(leaf, 0)
                              + tallies.get(leaf, SkipTally()).by_reason[REASON_STALE],
                              tallies.get(leaf, SkipTally())) for leaf in leaves}


def tree_skips(tree: Location) -> SkipTally:
    """What every sidecar of a tree skips (a local folder or a version's `s3://` prefix)."""
    tally = SkipTally()
    for sidecar in tree_sidecars(tree):
        tally.add(read_sidecar(sidecar))
    return tally


def skipped_ids(tree: Location | str | PurePath, mapping: TableRef,
                reasons: Iterable[str] | None = None, batch_rows: int = SCAN_ROWS) -> pa.Array:
    """The live ids a tree's sidecars skip (for the selected reasons; all by default), as
    one Arrow array of unique ids. The mapping is streamed and each batch joined in Arrow
    with its shards' skipped positions: Python objects per shard, none per mapping row or
    skipped sample (a rewrite may skip tens of millions)."""
    tree = as_location(tree)
    wanted = None if reasons is None else list(reasons)
    per_shard: dict[ShardKey, pa.Table] = {}
    found: list[pa.Array] = []
    for batch in mapping_batches(mapping, batch_rows):
        rows = pa.Table.from_batches([batch])
        pairs = rows.group_by(["leaf", "shard"]).aggregate([])
        for leaf, shard in zip(pairs.column("leaf").to_pylist(),
                               pairs.column("shard").to_pylist(), strict=True):
            if (leaf, shard) not in per_shard:
                lists = read_sidecar(tree / leaf / sidecar_name(shard))
                per_shard[(leaf, shard)] = _positions(leaf, shard,
                                                      skipped_indices(lists, wanted))
        skipped = pa.concat_tables(per_shard[key] for key in zip(
            pairs.column("leaf").to_pylist(), pairs.column("shard").to_pylist(), strict=True))
        if skipped.num_rows:
            hits = rows.join(skipped, ["leaf", "shard", "sample_index"], join_type="inner")
            found += hits.column("id").chunks
    return pc.unique(pa.concat_arrays(found)) if found else pa.array([], pa.string())


def id_values(ids: Collection[str] | pa.Array) -> pa.Array:
    """Ids as an Arrow value set (`pc.is_in`): an Arrow array as it is, else sorted."""
    return ids if isinstance(ids, pa.Array) else pa.array(sorted(ids), pa.string())


def _positions(leaf: str, shard: str, indices: set[int]) -> pa.Table:
    """One shard's skipped sample positions as (leaf, shard, sample_index) rows."""
    n = len(indices)
    return pa.table({"leaf": pa.repeat(pa.scalar(leaf, pa.string()), n),
                     "shard": pa.repeat(pa.scalar(shard, pa.string()), n),
                     "sample_index": pa.array(sorted(indices), pa.int64())})


def reasons_in(tree: Location) -> set[str]:
    return {reason for sidecar in tree_sidecars(tree) for reason in read_sidecar(sidecar)}
