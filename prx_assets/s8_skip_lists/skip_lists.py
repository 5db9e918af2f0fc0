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
from prx_assets.storage.filters import all_of, eq_filter, in_filter, sql_string

SIDECAR_VERSION = 1
SHARD_SUFFIX = ".mds"
SIDECAR_SUFFIX = ".skip.json"
REASON_DEDUP, REASON_OPTOUT = "dedup", "optout"
ABLATION_NAME = re.compile(r"^[a-z0-9_]+$")
# An ablation list is its own reason, so it cannot take a built-in reason's name.
RESERVED_REASONS = frozenset({"dedup", "optout", "text", "nsfw", "visual"})
# Columns of the MDS mapping table (`mds_samples`) a skip list needs.
MAPPING_COLUMNS = ["id", "leaf", "shard", "sample_index"]

ShardKey = tuple[str, str]  # (leaf relative to the source's tree, shard file name)
SkipLists = dict[ShardKey, dict[str, list[int]]]


def sidecar_path(shard_path: str | Path) -> Path:
    """`.../shard.00003.mds` -> `.../shard.00003.skip.json`."""
    shard_path = Path(shard_path)
    return shard_path.with_name(shard_path.name.removesuffix(SHARD_SUFFIX) + SIDECAR_SUFFIX)


def read_sidecar(path: str | Path) -> dict[str, list[int]]:
    """The skip lists of one shard by reason; {} when the sidecar does not exist.
    (The training loader reads sidecars through this function.)"""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return {}
    if data.get("version") != SIDECAR_VERSION:
        raise ValueError(f"{path}: unsupported skip sidecar version {data.get('version')!r}")
    return {str(reason): [int(i) for i in indices] for reason, indices in data["lists"].items()}


def write_sidecar(path: Path, lists: Mapping[str, Iterable[int]]) -> None:
    """Atomically replace the sidecar; empty lists remove it (absent = nothing skipped)."""
    path = Path(path)
    clean = {reason: sorted({int(i) for i in ids}) for reason, ids in sorted(lists.items())}
    clean = {reason: ids for reason, ids in clean.items() if ids}
    if not clean:
        path.unlink(missing_ok=True)
        return
    body = json.dumps({"version": SIDECAR_VERSION, "lists": clean}, separators=(",", ":"))
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


def read_ablations(directory: Path) -> dict[str, set[str]]:
    """Named ablation lists: `<directory>/<name>.txt`, one id per line, `#` comments."""
    lists: dict[str, set[str]] = {}
    if not Path(directory).is_dir():
        return lists
    for path in sorted(Path(directory).glob("*.txt")):
        name = path.stem
        if not ABLATION_NAME.match(name):
            raise ValueError(f"{path}: ablation name {name!r} must match [a-z0-9_]+")
        if name in RESERVED_REASONS:
            raise ValueError(f"{path}: ablation name {name!r} is a built-in reason")
        lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
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


def apply_skip_lists(tree: Path, lists: SkipLists, shards: Iterable[ShardKey]) -> ApplyReport:
    """Write every shard's sidecar under `tree` (the source's current MDS tree); shards
    not in `lists` lose any stale sidecar. Unchanged sidecars are not rewritten."""
    report = ApplyReport()
    for leaf, shard in sorted(set(shards) | set(lists)):
        report.shards += 1
        new = lists.get((leaf, shard), {})
        path = sidecar_path(Path(tree) / leaf / shard)
        if read_sidecar(path) == new:
            report.unchanged += 1
            continue
        write_sidecar(path, new)
        failpoint("skip_lists.sidecar_written")
        if new:
            report.written += 1
        else:
            report.removed += 1
    for (leaf, _), by_reason in lists.items():
        for reason, ids in by_reason.items():
            report.skipped_per_reason[reason] += len(ids)
        report.skipped_per_leaf[leaf] = (report.skipped_per_leaf.get(leaf, 0)
                                         + len(skipped_indices(by_reason)))
    report.skipped_total = sum(report.skipped_per_leaf.values())
    return report


def mapping_batches(uri: Path, batch_rows: int = 1 << 18) -> Iterable[pa.RecordBatch]:
    return lance.dataset(str(uri)).scanner(columns=MAPPING_COLUMNS,
                                           batch_size=batch_rows).to_batches()


def mapping_shards(uri: Path, batch_rows: int = 1 << 18) -> tuple[set[ShardKey], dict[str, int]]:
    """Every shard of the mapping table, and samples per leaf (one stream each)."""
    shards: set[ShardKey] = set()
    per_leaf: Counter = Counter()
    for batch in lance.dataset(str(uri)).scanner(columns=["leaf", "shard"],
                                                 batch_size=batch_rows).to_batches():
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



def duplicate_ids(duplicates_uri: Path, source: str, batch_rows: int = 1 << 18) -> set[str]:
    """The source's non-kept copies (the kept copy of a group is listed with id == kept_id)."""
    if not Path(duplicates_uri).exists():
        return set()
    scanner = lance.dataset(str(duplicates_uri)).scanner(
        columns=["id"], batch_size=batch_rows,
        filter=f"id != kept_id AND starts_with(id, {sql_string(source + ':')})")
    return {i for batch in scanner.to_batches() for i in batch.column("id").to_pylist()}


def label_ids(labels_uri: Path, labels: Iterable[str], caption_version: str,
              classifier_version: str, batch_rows: int = 1 << 18) -> dict[str, set[str]]:
    """Ids per chosen label, from the active caption and classifier versions only."""
    labels = sorted(set(labels))
    found: dict[str, set[str]] = {label: set() for label in labels}
    if not labels or not Path(labels_uri).exists():
        return found
    condition = all_of(eq_filter("caption_version", caption_version),
                       eq_filter("classifier_version", classifier_version),
                       in_filter("label", labels))
    scanner = lance.dataset(str(labels_uri)).scanner(
        columns=["id", "label"], filter=condition, batch_size=batch_rows)
    for batch in scanner.to_batches():
        for sample_id, label in zip(batch.column("id").to_pylist(),
                                    batch.column("label").to_pylist()):
            found[label].add(sample_id)
    return found


def skip_shares(tree: Path, per_leaf: Mapping[str, int], shards: Iterable[ShardKey]
                ) -> dict[str, tuple[int, int]]:
    """(samples, skipped) per stream (leaf), read back from the sidecars on disk."""
    skipped: Counter = Counter()
    for leaf, shard in shards:
        skipped[leaf] += len(skipped_indices(read_sidecar(sidecar_path(Path(tree) / leaf / shard))))
    return {leaf: (n, skipped.get(leaf, 0)) for leaf, n in sorted(per_leaf.items())}


def skipped_ids(tree: Path, mapping_uri: Path, reasons: Iterable[str] | None = None,
                batch_rows: int = 1 << 18) -> set[str]:
    """The ids a tree's sidecars skip (for the selected reasons; all by default)."""
    wanted = None if reasons is None else list(reasons)
    per_shard: dict[ShardKey, set[int]] = {}
    found: set[str] = set()
    for batch in mapping_batches(mapping_uri, batch_rows):
        for sample_id, leaf, shard, index in zip(
                batch.column("id").to_pylist(), batch.column("leaf").to_pylist(),
                batch.column("shard").to_pylist(), batch.column("sample_index").to_pylist()):
            if (leaf, shard) not in per_shard:
                lists = read_sidecar(sidecar_path(Path(tree) / leaf / shard))
                per_shard[(leaf, shard)] = skipped_indices(lists, wanted)
            if index in per_shard[(leaf, shard)]:
                found.add(sample_id)
    return found


def reasons_in(tree: Path) -> set[str]:
    return {reason for path in sidecar_files(tree) for reason in read_sidecar(path)}
