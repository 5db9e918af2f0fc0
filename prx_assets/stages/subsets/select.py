"""Which samples a subset holds: the live samples of each source's current tree (its
`mds_samples` mapping) less everything the tree's skip lists skip, joined with the active
caption labels, attribute records and (when asked) concept clusters, filtered by the
definition, then capped per source and per cluster and cut to the target size.

Caps and the target keep the samples with the smallest rank, a hash of (seed, id): the
same definition over the same tables always selects the same samples, and a bigger target
keeps every sample a smaller one kept. Metadata only: no image bytes, no caption text.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prx_assets.stages.attributes.schema import ORIGIN_CAPTION, SCHEMA_VERSION, UNKNOWN, fields
from prx_assets.stages.subsets.definitions import AttributeCondition, SubsetDefinition
from prx_assets.storage.refs import Location, TableRef
from prx_assets.storage.sidecars import (
    by_default,
    read_sidecar,
    sidecar_name,
    skipped_indices,
)

MAPPING_COLUMNS = ["id", "source", "tier", "width", "height", "leaf", "shard", "sample_index"]


@dataclass(frozen=True)
class SourceTables:
    """One source's inputs, each pinned at the version the subset records as lineage."""

    source: str
    tree: Location  # the source's current MDS tree, resolved once
    mapping: TableRef  # mds_samples
    labels: TableRef | None = None
    labels_filter: str | None = None
    attributes: TableRef | None = None
    attributes_filter: str | None = None


def skipped_rows(mapping: pa.Table, tree: Location) -> pa.Array:
    """A boolean per mapping row: skipped by a sidecar of the tree for a reason the loader
    applies by default (not the opt-in ones), so a subset never carries a deduplicated,
    opted-out or unsafe sample."""
    skipped = np.zeros(mapping.num_rows, dtype=bool)
    if mapping.num_rows == 0:
        return pa.array(skipped)
    leaves = mapping.column("leaf").to_numpy(zero_copy_only=False)
    shards = mapping.column("shard").to_numpy(zero_copy_only=False)
    index = mapping.column("sample_index").to_numpy()
    for leaf, shard in {(str(a), str(b)) for a, b in zip(leaves, shards, strict=True)}:
        lists = read_sidecar(tree / leaf / sidecar_name(shard))
        skip = skipped_indices(by_default(lists))
        if skip:
            here = (leaves == leaf) & (shards == shard)
            skipped |= here & np.isin(index, list(skip))
    return pa.array(skipped)


def source_candidates(tables: SourceTables, definition: SubsetDefinition,
                      version: str = SCHEMA_VERSION) -> tuple[pa.Table, Counter]:
    """The source's live, unskipped samples with their label and attributes, and how many
    were dropped by skip lists. Only the columns the definition needs are read."""
    mapping = tables.mapping.to_table(columns=MAPPING_COLUMNS) if tables.mapping.exists() \
        else pa.schema([]).empty_table()
    dropped: Counter = Counter()
    if mapping.num_rows == 0:
        return mapping, dropped
    skipped = skipped_rows(mapping, tables.tree)
    dropped["skip_lists"] = int(pc.sum(skipped).as_py() or 0)
    rows = mapping.filter(pc.invert(skipped))
    if tables.labels is not None and tables.labels.exists():
        labels = tables.labels.to_table(columns=["id", "label"], filter=tables.labels_filter)
        rows = left_join(rows, labels)
    if tables.attributes is not None and tables.attributes.exists():
        wanted = ["id", "origin", *(f.name for f in fields(version))]
        attributes = tables.attributes.to_table(columns=wanted,
                                                filter=tables.attributes_filter)
        rows = left_join(rows, attributes)
    return rows, dropped


def left_join(rows: pa.Table, other: pa.Table, key: str = "id") -> pa.Table:
    """`rows` with `other`'s columns by `key` (one row per key in `other`; null where none).
    By position rather than Arrow's join, which refuses list columns such as `subjects`."""
    at = pc.index_in(rows.column(key), value_set=other.column(key).combine_chunks())
    for name in other.column_names:
        if name != key:
            rows = rows.append_column(name, other.column(name).combine_chunks().take(at))
    return rows


def with_clusters(rows: pa.Table, concepts: TableRef | None, level: int) -> pa.Table:
    """A `cluster` column: each sample's concept cluster at `level` (null: none)."""
    if concepts is None or not concepts.exists():
        return rows.append_column("cluster", pa.nulls(rows.num_rows, pa.int32()))
    clusters = concepts.to_table(columns=["id", "cluster"], filter=f"level = {int(level)}")
    return left_join(rows, clusters)


def condition_mask(rows: pa.Table, condition: AttributeCondition) -> pa.Array:
    """Rows meeting one attribute condition. A row without the attribute (null: withheld,
    or no record) meets it only when the condition lists `unknown`: unknown is not "no"."""
    if condition.field not in rows.column_names:
        return pa.array(np.full(rows.num_rows, UNKNOWN in condition.values))
    column = rows.column(condition.field)
    known = _known_mask(column, condition)
    if UNKNOWN in condition.values:
        return pc.or_(known, pc.is_null(column))
    return known


def _known_mask(column: pa.ChunkedArray, condition: AttributeCondition) -> pa.Array:
    if pa.types.is_list(column.type):
        column = column.combine_chunks()
        hits = pc.is_in(pc.list_flatten(column), value_set=pa.array(list(condition.values)))
        parents = pc.list_parent_indices(column).to_numpy()
        mask = np.zeros(len(column), dtype=bool)
        mask[parents[hits.to_numpy(zero_copy_only=False)]] = True
        return pa.array(mask)
    if condition.minimum is not None or condition.maximum is not None:
        mask = pc.is_valid(column)
        if condition.minimum is not None:
            mask = pc.and_(mask, pc.greater_equal(column, condition.minimum))
        if condition.maximum is not None:
            mask = pc.and_(mask, pc.less_equal(column, condition.maximum))
        return pc.fill_null(mask, False)
    values = [v for v in condition.values if v != UNKNOWN]
    return pc.fill_null(pc.is_in(column, value_set=pa.array(values, column.type)), False)


def filter_rows(rows: pa.Table, definition: SubsetDefinition) -> tuple[pa.Table, Counter]:
    """The rows the definition's conditions keep, and how many each condition dropped."""
    dropped: Counter = Counter()

    def keep(name: str, mask: pa.Array) -> None:
        nonlocal rows
        mask = pc.fill_null(mask, False)
        dropped[name] += rows.num_rows - int(pc.sum(mask).as_py() or 0)
        rows = rows.filter(mask)

    if definition.sources:
        keep("sources", pc.is_in(rows.column("source"),
                                 value_set=pa.array(list(definition.sources))))
    if definition.tiers:
        keep("tiers", pc.is_in(rows.column("tier"),
                               value_set=pa.array(list(definition.tiers), pa.int32())))
    if definition.labels:
        labels = rows.column("label") if "label" in rows.column_names \
            else pa.nulls(rows.num_rows, pa.string())
        keep("labels", pc.is_in(labels, value_set=pa.array(list(definition.labels))))
    if definition.attributes and not definition.caption_derived:
        origin = rows.column("origin") if "origin" in rows.column_names \
            else pa.nulls(rows.num_rows, pa.string())
        keep("caption_derived", pc.not_equal(origin, ORIGIN_CAPTION))
    for condition in definition.attributes:
        keep(f"attributes.{condition.field}", condition_mask(rows, condition))
    if definition.concept_clusters:
        keep("concepts", pc.is_in(rows.column("cluster"), value_set=pa.array(
            list(definition.concept_clusters), rows.column("cluster").type)))
    return rows, +dropped


def ranks(ids: Iterable[str], seed: int) -> np.ndarray:
    """A stable pseudo-random rank per id (the order caps and the target keep)."""
    salt = str(seed).encode()
    return np.array([int.from_bytes(hashlib.blake2b(salt + i.encode(), digest_size=8).digest(),
                                    "big") >> 1 for i in ids], dtype=np.int64)


def capped(rows: pa.Table, definition: SubsetDefinition) -> tuple[pa.Table, Counter]:
    """Rows in rank order, at most `cap_per_source` per source and `cap_per_cluster` per
    concept cluster (a sample without a cluster is its own), then the first `target_size`."""
    dropped: Counter = Counter()
    if rows.num_rows == 0:
        return rows, dropped
    order = np.argsort(ranks(rows.column("id").to_pylist(), definition.seed), kind="stable")
    rows = rows.take(pa.array(order))
    for key, cap in (("source", definition.cap_per_source),
                     ("cluster", definition.cap_per_cluster)):
        if cap is None or key not in rows.column_names:
            continue
        seen: Counter = Counter()
        mask = []
        for value in rows.column(key).to_pylist():
            seen[value] += 1
            mask.append(value is None or seen[value] <= cap)
        dropped[f"cap_per_{key}"] = mask.count(False)
        rows = rows.filter(pa.array(mask))
    if definition.target_size is not None and rows.num_rows > definition.target_size:
        dropped["target_size"] = rows.num_rows - definition.target_size
        rows = rows.slice(0, definition.target_size)
    return rows, +dropped


@dataclass
class Selection:
    rows: pa.Table  # the chosen samples, in rank order
    candidates: int  # live samples of the sources read
    dropped: Counter  # by reason: skip_lists, each condition, caps, target


def select(tables: list[SourceTables], definition: SubsetDefinition,
           concepts: TableRef | None = None) -> Selection:
    """The subset's samples across its sources."""
    dropped: Counter = Counter()
    parts, total = [], 0
    for source in tables:
        if definition.sources and source.source not in definition.sources:
            continue
        rows, skipped = source_candidates(source, definition)
        total += rows.num_rows + skipped["skip_lists"]
        dropped.update(skipped)
        if rows.num_rows:
            parts.append(rows)
    rows = pa.concat_tables(parts, promote_options="permissive") if parts \
        else pa.schema([(c, pa.string()) for c in MAPPING_COLUMNS]).empty_table()
    if definition.needs_concepts and rows.num_rows:
        rows = with_clusters(rows, concepts, definition.concept_level)
    rows, filtered = filter_rows(rows, definition)
    rows, cut = capped(rows, definition)
    dropped.update(filtered)
    dropped.update(cut)
    return Selection(rows, total, +dropped)
