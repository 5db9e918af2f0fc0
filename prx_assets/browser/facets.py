"""The grid's facets: the query a page's URL holds, the filter its facets make over the
corpus table, and the counts per facet value among the current matches.

`source`, `label`, `tier` and `shape` are columns of the corpus. `dup` and `skip` are sets
of ids (`IdSet`): the members of exact-duplicate groups, and the ids each skip reason
removes, read back from the sidecars through the mapping tables; each set is built once per
table version (or set of sidecar files) and can hold up to MAX_ID_SET ids. So the filter is
an Arrow expression that Lance takes as the scanner's `filter` (`id` in the set's array),
never SQL with every id quoted into it. Counting those two facets over the matches reads no
ids at all: a `Membership` marks their rows by row address once per corpus version.
"""

from __future__ import annotations

import functools
import operator
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prx_assets.browser.catalog import (
    NAME,
    BadQuery,
    Catalog,
    Sidecar,
    applies_by_default,
    valid_id,
)
from prx_assets.stages.attributes.schema import UNKNOWN, field_named
from prx_assets.stages.labels.labels import LABELS
from prx_assets.storage.tables import DUPLICATES, MDS_SAMPLES

if TYPE_CHECKING:
    from collections.abc import Iterable

    from lance import LanceDataset

SHAPE = re.compile(r"^([0-9]{1,5})x([0-9]{1,5})$")
DUP_VALUES = ("duplicate", "kept", "unique")
# Read with each row's address: the duplicate and skip facets are counted from it, so the
# facet scan reads no strings but the two low-cardinality ones.
FACET_COLUMNS = ["source", "label", "tier", "width", "height"]
# Attribute facets (corpus columns when the corpus carries attributes): one value each, and
# the qualities as "at least N" range filters (`<name>_min`), counted cumulatively.
ATTRIBUTE_FACETS = ("medium", "visible_text", "people", "setting", "style", "watermark")
QUALITY_FACETS = ("aesthetic_quality", "technical_quality")
# Provenance facets (corpus columns since reservations are read at ingest; docs/rights.md):
# the training reservation, with its `reserved` badge on the tiles, and the license.
PROVENANCE_FACETS = ("reservation", "license")
RESERVATIONS = ("none", "constrained", "prohibited")
LICENSE = re.compile(r"^[\w.+:/ -]{1,100}$")
# Id sets that feed a facet filter (duplicates, skip reasons) are read with this limit.
MAX_ID_SET = 100_000
MAX_CONCEPT_LEVEL, MAX_CLUSTER = 8, 10_000_000
MAX_TIER = 100_000  # tiers are a bucket's side in pixels (256 ... 2048)
SPACES = ("image",)  # more like this besides the default caption space


@dataclass(frozen=True)
class Query:
    """The grid's state, from the page's URL parameters (validated)."""

    text: str = ""
    similar: str = ""
    source: str = ""
    label: str = ""
    tier: int | None = None
    shape: str = ""
    dup: str = ""
    skip: str = ""
    page: int = 0
    attributes: tuple[tuple[str, str], ...] = ()  # (attribute, value) of ATTRIBUTE_FACETS
    minimums: tuple[tuple[str, int], ...] = ()  # (quality, at least) of QUALITY_FACETS
    level: int | None = None  # the concept facet's level (1 = leaves); None: the top one
    concept: int | None = None  # a cluster of `level` (the concepts table)
    space: str = ""  # more like this in "image" space (image_embeddings); "": captions

    @classmethod
    def parse(cls, params: dict[str, str]) -> Query:
        text = (params.get("q") or "").strip()[:500]
        similar = (params.get("similar") or "").strip()
        if similar:
            valid_id(similar)
        source = params.get("source") or ""
        if source and not NAME.match(source):
            raise BadQuery(f"source {source!r} is not a source name")
        label = params.get("label") or ""
        if label and label not in LABELS:
            raise BadQuery(f"label must be one of {', '.join(LABELS)}")
        tier = _small_number(params, "tier", MAX_TIER)  # beyond: an int32 filter overflows
        shape = params.get("shape") or ""
        if shape and not SHAPE.match(shape):
            raise BadQuery("shape must look like 512x512")
        dup = params.get("dup") or ""
        if dup and dup not in DUP_VALUES:
            raise BadQuery(f"dup must be one of {', '.join(DUP_VALUES)}")
        skip = params.get("skip") or ""
        if skip and not NAME.match(skip):
            raise BadQuery("skip must be a reason name")
        page_text = params.get("page") or "0"
        if not page_text.isdigit() or int(page_text) > 100_000:
            raise BadQuery("page must be a small number")
        level, concept = _concept_params(params)
        space = params.get("space") or ""
        if space and space not in SPACES:
            raise BadQuery(f"space must be one of {', '.join(SPACES)}")
        return cls(text, similar, source, label, tier, shape,
                   dup, skip, int(page_text), *_attribute_params(params), level=level,
                   concept=concept, space=space)

    def params(self, **changes: object) -> dict[str, str]:
        """URL parameters of this query with some changed ('' removes one); page resets."""
        values = {"q": self.text, "similar": self.similar, "source": self.source,
                  "label": self.label, "tier": "" if self.tier is None else str(self.tier),
                  "shape": self.shape, "dup": self.dup, "skip": self.skip, "page": "",
                  **dict(self.attributes),
                  **{f"{name}_min": str(n) for name, n in self.minimums},
                  "level": "" if self.level is None else str(self.level),
                  "concept": "" if self.concept is None else str(self.concept),
                  "space": self.space}
        values.update({k: "" if v is None else str(v) for k, v in changes.items()})
        return {k: v for k, v in values.items() if v}

    @property
    def filtered(self) -> bool:
        return any((self.source, self.label, self.tier is not None, self.shape, self.dup,
                    self.skip, self.attributes, self.minimums, self.concept is not None))


def _small_number(params: dict[str, str], name: str, most: int) -> int | None:
    text = params.get(name) or ""
    if not text:
        return None
    if not text.isdigit() or int(text) > most:
        raise BadQuery(f"{name} must be a number up to {most}")
    return int(text)


def _concept_params(params: dict[str, str]) -> tuple[int | None, int | None]:
    """The concept facet's level and cluster (a cluster needs its level)."""
    level = _small_number(params, "level", MAX_CONCEPT_LEVEL)
    concept = _small_number(params, "concept", MAX_CLUSTER)
    if concept is not None and level is None:
        raise BadQuery("concept needs a level")
    return level, concept


def _attribute_params(params: dict[str, str]
                      ) -> tuple[tuple[tuple[str, str], ...], tuple[tuple[str, int], ...]]:
    """The attribute facets a URL chooses, checked against the attribute schema."""
    chosen = []
    for name in ATTRIBUTE_FACETS:
        value = params.get(name) or ""
        if value:
            allowed = [str(v).lower() for v in field_named(name).values] + [UNKNOWN]
            if value not in allowed:
                raise BadQuery(f"{name} must be one of {', '.join(allowed)}")
            chosen.append((name, value))
    chosen += _provenance_params(params)
    minimums = []
    for name in QUALITY_FACETS:
        text = params.get(f"{name}_min") or ""
        if text:
            if not text.isdigit() or int(text) not in field_named(name).values:
                raise BadQuery(f"{name}_min must be 1 to 5")
            minimums.append((name, int(text)))
    return tuple(chosen), tuple(minimums)


def _provenance_params(params: dict[str, str]) -> list[tuple[str, str]]:
    chosen = []
    reservation, license = params.get("reservation") or "", params.get("license") or ""
    if reservation:
        if reservation not in RESERVATIONS:
            raise BadQuery(f"reservation must be one of {', '.join(RESERVATIONS)}")
        chosen.append(("reservation", reservation))
    if license:
        if not LICENSE.match(license):
            raise BadQuery("license must be a license name")
        chosen.append(("license", license))
    return chosen


# ------------------------------------------------------------------------------- id sets

@dataclass(frozen=True)
class IdSet:
    """Ids behind one facet value, as a set and as the sorted Arrow array that filters and
    counts use (built once per table version, not per request)."""

    ids: frozenset[str]
    array: pa.Array

    @classmethod
    def of(cls, ids: Iterable[str]) -> IdSet:
        members = frozenset(ids)
        return cls(members, pa.array(sorted(members), pa.string()))

    def __len__(self) -> int:
        return len(self.ids)

    def __contains__(self, sample_id: object) -> bool:
        return sample_id in self.ids


IdSets = dict[str, dict[str, IdSet]]  # {"dup": {value: ids}, "skip": {reason: ids}}


def id_sets(catalog: Catalog) -> IdSets:
    """Ids behind the `dup` and `skip` facets: {"dup": {value: ids}, "skip": {reason: ids}}."""
    return {"dup": duplicate_sets(catalog), "skip": skipped_sets(catalog)}


def duplicate_sets(catalog: Catalog) -> dict[str, IdSet]:
    """Members of exact-duplicate groups: the copies removed and the copies kept."""
    table = catalog.dataset(DUPLICATES)
    if table is None:
        return {"duplicate": IdSet.of(()), "kept": IdSet.of(())}

    def compute() -> dict[str, IdSet]:
        rows = table.to_table(columns=["id", "kept_id"], limit=MAX_ID_SET)
        kept = pc.equal(rows.column("id"), rows.column("kept_id"))
        return {"duplicate": IdSet.of(rows.filter(pc.invert(kept)).column("id").to_pylist()),
                "kept": IdSet.of(rows.filter(kept).column("id").to_pylist())}

    return catalog.cached(("dup", table.uri, table.version), compute)


def _sidecar_stamps(catalog: Catalog) -> tuple:
    """Path and mtime of every sidecar (a changed skip list changes the key); re-listed at
    most every `ttl_s` seconds of the catalog, like the tables."""
    return catalog.fresh("sidecar stamps", lambda: tuple(
        sidecar.stamp() for source in catalog.sources_of(MDS_SAMPLES)
        for sidecar in catalog.sidecars(source)))


def skipped_sets(catalog: Catalog) -> dict[str, IdSet]:
    """Ids each skip reason removes, read back from the sidecars of every source's current
    MDS tree through its mapping table (the same files the loader reads)."""
    stamps = _sidecar_stamps(catalog)

    def compute() -> dict[str, IdSet]:
        ids: dict[str, set[str]] = {}
        for source in catalog.sources_of(MDS_SAMPLES):
            mapping = catalog.dataset(MDS_SAMPLES, source)
            if mapping is None:
                continue
            for sidecar in catalog.sidecars(source):
                for reason, indices in sidecar.lists().items():
                    if indices:
                        ids.setdefault(reason, set()).update(
                            _ids_at(mapping, sidecar, indices))
        return {reason: IdSet.of(v) for reason, v in sorted(ids.items())}

    return catalog.cached(("skip", stamps), compute)


def _ids_at(mapping: LanceDataset, sidecar: Sidecar, indices: list[int]) -> list[str]:
    """Ids stored at these indices of the sidecar's shard (from the mapping table)."""
    where = ((pc.field("leaf") == sidecar.leaf) & (pc.field("shard") == sidecar.shard)
             & pc.field("sample_index").isin(pa.array(indices, pa.int64())))
    rows = mapping.to_table(columns=["id"], filter=where, limit=min(len(indices), MAX_ID_SET))
    return rows.column("id").to_pylist()


# -------------------------------------------------------------------------------- filter

def corpus_filter(query: Query, sets: IdSets | None) -> pc.Expression | None:
    """The filter of the query's facets over the corpus table (None: no facet chosen).
    Without `sets` the `dup` and `skip` facets are left out."""
    parts: list[pc.Expression] = []
    if query.source:
        parts.append(pc.field("source") == query.source)
    if query.label:
        parts.append(pc.field("label") == query.label)
    if query.tier is not None:
        parts.append(pc.field("tier") == query.tier)
    if query.shape:
        width, height = query.shape.split("x")
        parts.append((pc.field("width") == int(width)) & (pc.field("height") == int(height)))
    for name, value in query.attributes:
        if value == UNKNOWN:  # withheld or not told: null, never read as "no"
            parts.append(pc.field(name).is_null())
        else:
            parts.append(pc.field(name) == (value == "true" if name == "watermark" else value))
    for name, least in query.minimums:
        parts.append(pc.field(name) >= least)
    if query.dup and sets is not None:
        dups = sets["dup"]
        if query.dup == "unique":
            parts.append(~pc.field("id").isin(_union(dups.values())))
        else:
            parts.append(pc.field("id").isin(dups[query.dup].array))
    if query.skip and sets is not None:
        skips = sets["skip"]
        if query.skip == "any":  # any reason the loader applies by default
            chosen = [ids for reason, ids in skips.items() if applies_by_default(reason)]
        else:
            chosen = [skips[query.skip]] if query.skip in skips else []
        parts.append(pc.field("id").isin(_union(chosen)))
    return functools.reduce(operator.and_, parts) if parts else None


def _union(sets: Iterable[IdSet]) -> pa.Array:
    """The ids of several sets, each once (an empty string array for none)."""
    arrays = [ids.array for ids in sets]
    return pc.unique(pa.chunked_array(arrays, pa.string()))


# -------------------------------------------------------------------------------- counts

class Membership:
    """Which rows of one corpus version belong to each facet id set, by row address
    (fragment id << 32 | offset): a boolean mask per fragment, built with one scan of the
    id column per corpus version and facet set, so counting a facet over the current
    matches reads no ids."""

    def __init__(self, masks: dict[tuple[str, str], dict[int, np.ndarray]]):
        self.masks = masks

    @classmethod
    def build(cls, table: LanceDataset, sets: IdSets, batch_rows: int = 1 << 18
              ) -> Membership:
        wanted = {(facet, value): ids for facet, values in sets.items()
                  for value, ids in values.items() if len(ids)}
        found: dict[tuple[str, str], list[np.ndarray]] = {key: [] for key in wanted}
        scanner = table.scanner(columns=["id"], with_row_address=True, batch_size=batch_rows)
        for batch in scanner.to_batches():
            addresses = batch.column("_rowaddr").to_numpy()
            for key, ids in wanted.items():
                hit = pc.fill_null(pc.is_in(batch.column("id"), value_set=ids.array), False)
                found[key].append(addresses[hit.to_numpy(zero_copy_only=False)])
        return cls({key: _fragment_masks(parts) for key, parts in found.items()})

    def count(self, key: tuple[str, str], addresses: RowAddresses) -> int:
        per_fragment = self.masks.get(key)
        if not per_fragment or addresses.size == 0:
            return 0
        total = 0
        for fragment, mask in per_fragment.items():
            mine = addresses.offsets_in(fragment)
            total += int(mask[mine[mine < mask.size]].sum())
        return total


def _fragment_masks(parts: list[np.ndarray]) -> dict[int, np.ndarray]:
    """Row addresses as one boolean mask of offsets per fragment id."""
    addresses = np.concatenate(parts) if parts else np.empty(0, np.uint64)
    fragments, offsets = addresses >> np.uint64(32), addresses & np.uint64(0xFFFFFFFF)
    masks = {}
    for fragment in np.unique(fragments):
        mine = offsets[fragments == fragment].astype(np.int64)
        mask = np.zeros(int(mine.max()) + 1, bool)
        mask[mine] = True
        masks[int(fragment)] = mask
    return masks


class RowAddresses:
    """Row addresses split once into fragment ids and offsets, for several counts."""

    def __init__(self, addresses: np.ndarray):
        addresses = np.asarray(addresses, np.uint64)
        self.size = addresses.size
        self.fragments = addresses >> np.uint64(32)
        self.offsets = (addresses & np.uint64(0xFFFFFFFF)).astype(np.int64)
        self.single = int(self.fragments[0]) if self.size and \
            (self.fragments == self.fragments[0]).all() else None

    def offsets_in(self, fragment: int) -> np.ndarray:
        if self.single is not None:
            return self.offsets if fragment == self.single else self.offsets[:0]
        return self.offsets[self.fragments == fragment]


def membership(catalog: Catalog, table: LanceDataset, sets: IdSets | None
               ) -> Membership | None:
    if sets is None:
        return None
    key = ("membership", table.uri, table.version,
           tuple((facet, value, len(ids), hash(ids.ids)) for facet, values in sets.items()
                 for value, ids in values.items()))
    return catalog.cached(key, lambda: Membership.build(table, sets))


def facet_counts(rows: pa.Table, sets: IdSets | None, members: Membership | None = None
                 ) -> dict[str, list[tuple[str, int]]]:
    """Counts per value of each facet among `rows` (the current matches, with `_rowaddr`
    when `members` counts the duplicate and skip facets)."""
    facets = {**_column_facets(rows), **attribute_facets(rows)}
    if sets is not None and members is not None:
        addresses = RowAddresses(rows.column("_rowaddr").to_numpy())
        dup_counts = {v: members.count(("dup", v), addresses) for v in ("duplicate", "kept")}
        dup_counts["unique"] = rows.num_rows - sum(dup_counts.values())
        facets["dup"] = [(v, n) for v, n in dup_counts.items() if n]
        skip = [(reason, members.count(("skip", reason), addresses)) for reason in sets["skip"]]
        # Skipped by default, and the opt-in lists (counted, not skipped unless named).
        facets["skip"] = [(r, n) for r, n in skip if n and applies_by_default(r)]
        facets["opt_in"] = [(r, n) for r, n in skip if n and not applies_by_default(r)]
    return facets


def _column_facets(rows: pa.Table) -> dict[str, list[tuple[str, int]]]:
    """Counts of the facets that are corpus columns: source, label, tier and shape."""
    # One grouping over every facet column at once (a few thousand groups at most), then
    # each facet's counts summed from the groups: one pass over the matches, not four.
    groups = rows.select(FACET_COLUMNS).group_by(FACET_COLUMNS).aggregate([([], "count_all")])
    sums: dict[str, dict[str, int]] = {"source": {}, "label": {}, "tier": {}, "shape": {},
                                       "tier_shape": {}}
    columns = [groups.column(name).to_pylist() for name in [*FACET_COLUMNS, "count_all"]]
    for source, label, tier, width, height, n in zip(*columns, strict=True):
        for facet, value in (("source", source), ("label", label), ("tier", tier),
                             ("shape", f"{width}x{height}" if width and height else None)):
            if value is not None:
                sums[facet][str(value)] = sums[facet].get(str(value), 0) + n
        if tier is not None and width and height:  # the shape facet's grid: tier x shape
            key = f"{tier}:{width}x{height}"
            sums["tier_shape"][key] = sums["tier_shape"].get(key, 0) + n

    def ordered(facet: str) -> list[tuple[str, int]]:
        return sorted(sums[facet].items(), key=lambda p: (-p[1], p[0]))

    return {"source": ordered("source"), "label": ordered("label"),
            "tier": sorted(sums["tier"].items(), key=lambda p: int(p[0])),
            "shape": ordered("shape"), "tier_shape": ordered("tier_shape")}


def facet_columns(table: LanceDataset) -> list[str]:
    """The columns the facets count: the corpus's own, and its attributes when it has them
    (a corpus built before attributes has none)."""
    names = set(table.schema.names)
    return [*FACET_COLUMNS, *(c for c in (*ATTRIBUTE_FACETS, *QUALITY_FACETS,
                                           *PROVENANCE_FACETS) if c in names)]


def attribute_facets(rows: pa.Table) -> dict[str, list[tuple[str, int]]]:
    """Counts per attribute value among the matches, and per quality "at least N"."""
    facets: dict[str, list[tuple[str, int]]] = {}
    for name in ATTRIBUTE_FACETS:
        if name in rows.column_names:
            column = rows.column(name)
            counts = pc.value_counts(pc.drop_null(column))
            pairs = [(str(v["values"].as_py()).lower(), int(v["counts"].as_py()))
                     for v in counts]
            if column.null_count:
                pairs.append((UNKNOWN, column.null_count))
            facets[name] = sorted(pairs, key=lambda p: (-p[1], p[0]))
    for name in QUALITY_FACETS:
        if name in rows.column_names:
            values = pc.drop_null(rows.column(name)).to_numpy(zero_copy_only=False)
            cumulative = [(str(n), int((values >= n).sum())) for n in range(5, 0, -1)]
            facets[f"{name}_min"] = [(v, c) for v, c in cumulative if c]
    for name in PROVENANCE_FACETS:  # values as they are (a license keeps its spelling)
        if name in rows.column_names:
            counts = pc.value_counts(pc.drop_null(rows.column(name)))
            facets[name] = sorted(((str(v["values"].as_py()), int(v["counts"].as_py()))
                                   for v in counts), key=lambda p: (-p[1], p[0]))
    return facets
