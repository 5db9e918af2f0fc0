"""What the corpus browser shows, as Lance queries over the pipeline's own tables.

No Dagster and no web framework here, so every view's data can be tested and benchmarked
on its own. Every query projects the columns it needs and carries a limit (or counts rows
without reading them); no view reads a whole table into memory.

Table locations come from the storage layer (`Storage.table`), for sources found by listing
the storage root (or, on object storage, named in the sources file): a request names a
sample id, which is looked up in a table, and a source only counts once it is one of those;
nothing from a request is joined into a path. Values that reach a Lance filter are validated
first and quoted.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prx_assets.stages.labels.labels import LABELS
from prx_assets.storage import object_store
from prx_assets.storage.layout import Storage, as_storage
from prx_assets.storage.filters import in_filter, sql_string
from prx_assets.storage.tables import (
    BUCKETED_IMAGES, CAPTION_LABELS, CAPTIONS, CORPUS, DUPLICATES, MDS_SAMPLES, OPT_OUTS,
    PER_SOURCE, RAW_IMAGES)
from prx_assets.stages.shards.mds import current_tree
from prx_assets.stages.corpus.search import NPROBES, REFINE_FACTOR, Hit as Tile
from prx_assets.stages.skip_lists.skip_lists import read_sidecar, sidecar_files, sidecar_path

PAGE_SIZE = 48
# A search's facet counts are over its best hits, not every match (BM25 needs a limit).
MAX_SEARCH_HITS = 1000
SIMILAR_K = 96
# Facet counts read the facet columns of at most this many matches (the page says when the
# counts cover only part of a larger match set).
MAX_FACET_ROWS = 1_000_000
# Id sets that feed a facet filter (duplicates, skip reasons) are read with this limit.
MAX_ID_SET = 100_000
# Near-duplicate clusters are found among the first rows of the corpus' phash column.
NEAR_MAX_ROWS = 1_000_000
NEAR_MAX_DISTANCE = 4
# Pairs compared per band and offset (bounds the work when many hashes share a band).
NEAR_MAX_RUN = 64
CAPTION_CHARS = 140
TABLE_TTL_S = 2.0  # a table opened is reused this long before its latest version is checked

SAMPLE_ID = re.compile(r"^[a-z0-9_]+:[0-9A-Za-z_.\-]{1,128}$")
NAME = re.compile(r"^[a-z0-9_]+$")
SHAPE = re.compile(r"^([0-9]{1,5})x([0-9]{1,5})$")
DUP_VALUES = ("duplicate", "kept", "unique")
GRID_COLUMNS = ["id", "source", "label", "tier", "width", "height", "caption"]
# Read with each row's address: the duplicate and skip facets are counted from it, so the
# facet scan reads no strings but the two low-cardinality ones.
FACET_COLUMNS = ["source", "label", "tier", "width", "height"]


@dataclass(frozen=True)
class IdSet:
    """Ids behind one facet value, as a set and as the sorted Arrow array that counts and
    filters use (built once per table version, not per request)."""

    ids: frozenset[str]
    array: pa.Array

    @classmethod
    def of(cls, ids) -> "IdSet":
        ids = frozenset(ids)
        return cls(ids, pa.array(sorted(ids), pa.string()))

    def __len__(self) -> int:
        return len(self.ids)

    def __contains__(self, sample_id: str) -> bool:
        return sample_id in self.ids


class NotFound(Exception):
    """The thing asked for does not exist (the web app answers 404)."""


class BadQuery(ValueError):
    """A parameter that cannot be a valid value (the web app answers 400)."""


def valid_id(sample_id: str) -> str:
    if not isinstance(sample_id, str) or not SAMPLE_ID.match(sample_id):
        raise NotFound(f"no sample with id {sample_id!r}")
    return sample_id


# ----------------------------------------------------------------------------- table catalog

class Catalog:
    """The storage root's tables; datasets are opened once and re-checked for a newer
    version every TABLE_TTL_S seconds."""

    def __init__(self, storage: Storage | str | Path):
        self.storage = as_storage(storage)
        self._lock = threading.Lock()
        self._open: dict[str, tuple[float, lance.LanceDataset | None]] = {}
        self._cache: dict[tuple, Any] = {}
        self._fresh: dict[str, tuple[float, Any]] = {}

    def _dataset(self, uri: str) -> lance.LanceDataset | None:
        now = time.monotonic()
        with self._lock:
            held = self._open.get(uri)
        if held and now - held[0] < TABLE_TTL_S:
            return held[1]
        dataset = held[1] if held else None
        try:
            if dataset is None or dataset.latest_version != dataset.version:
                dataset = lance.dataset(uri, storage_options=self.storage.lance_options())
        except (ValueError, FileNotFoundError, OSError):
            dataset = None  # not written yet
        with self._lock:
            self._open[uri] = (now, dataset)
        return dataset

    def sources_of(self, asset: str) -> list[str]:
        """Sources that have a table of the per-source `asset`: the `<source>.lance` folders
        under `lance/<asset>/`, listed from the storage root (a folder, or an `s3://` prefix:
        there one listing request, reused for TABLE_TTL_S seconds)."""
        if asset not in PER_SOURCE:
            return []
        folder = self.storage.table(asset, "x").rsplit("/", 1)[0]
        listing = lambda: _table_sources(folder, self.storage.storage_options)  # noqa: E731
        return listing() if self.storage.is_local else self.fresh(f"sources/{asset}", listing)

    def table(self, asset: str, source: str | None = None) -> lance.LanceDataset | None:
        """The global table `asset`, or its table for a known `source` (else None)."""
        if source is None:
            return self._dataset(self.storage.table(asset))
        if source not in self.sources_of(asset):
            return None
        return self._dataset(self.storage.table(asset, source))

    def corpus(self) -> lance.LanceDataset:
        table = self.table(CORPUS)
        if table is None:
            raise NotFound("no corpus table yet: materialise the `corpus` asset "
                           "(e.g. `make demo`)")
        return table

    def mds_tree(self, source: str) -> Path | None:
        if source not in self.sources_of(MDS_SAMPLES) or not self.storage.is_local:
            return None
        try:
            return current_tree(self.storage.local_path(self.storage.mds_root), source)
        except FileNotFoundError:
            return None

    def cached(self, key: tuple, compute: Callable[[], Any]) -> Any:
        """One value per key (keys hold table versions or file stamps, so they go stale by
        themselves); at most a few dozen keys are ever held."""
        with self._lock:
            if key in self._cache:
                return self._cache[key]
        value = compute()
        with self._lock:
            while len(self._cache) >= 64:  # the oldest keys are the stale versions
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = value
        return value

    def fresh(self, name: str, compute: Callable[[], Any]) -> Any:
        """`compute()`, reused for TABLE_TTL_S seconds (for things without a version, such
        as the list of sidecar files)."""
        now = time.monotonic()
        with self._lock:
            held = self._fresh.get(name)
        if held and now - held[0] < TABLE_TTL_S:
            return held[1]
        value = compute()
        with self._lock:
            self._fresh[name] = (now, value)
        return value


def _table_sources(folder: str, storage_options: Mapping[str, str] | None) -> list[str]:
    """Names of the `<name>.lance` tables directly in `folder` (local or object store)."""
    import pyarrow.fs as pafs

    fs, path = object_store.filesystem(folder, storage_options)
    infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    names = (i.base_name.removesuffix(".lance") for i in infos
             if i.type == pafs.FileType.Directory and i.base_name.endswith(".lance"))
    return sorted(n for n in names if NAME.match(n))


# ----------------------------------------------------------------------------------- filters

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

    @classmethod
    def parse(cls, params: dict[str, str]) -> "Query":
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
        tier_text = params.get("tier") or ""
        if tier_text and not tier_text.isdigit():
            raise BadQuery("tier must be a number")
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
        return cls(text, similar, source, label, int(tier_text) if tier_text else None, shape,
                   dup, skip, int(page_text))

    def params(self, **changes) -> dict[str, str]:
        """URL parameters of this query with some changed ('' removes one); page resets."""
        values = {"q": self.text, "similar": self.similar, "source": self.source,
                  "label": self.label, "tier": "" if self.tier is None else str(self.tier),
                  "shape": self.shape, "dup": self.dup, "skip": self.skip, "page": ""}
        values.update({k: "" if v is None else str(v) for k, v in changes.items()})
        return {k: v for k, v in values.items() if v}

    @property
    def filtered(self) -> bool:
        return any((self.source, self.label, self.tier is not None, self.shape, self.dup,
                    self.skip))


def id_sets(catalog: Catalog) -> dict[str, dict[str, IdSet]]:
    """Ids behind the `dup` and `skip` facets: {"dup": {value: ids}, "skip": {reason: ids}}."""
    return {"dup": duplicate_sets(catalog), "skip": skipped_sets(catalog)}


def duplicate_sets(catalog: Catalog) -> dict[str, IdSet]:
    """Members of exact-duplicate groups: the copies removed and the copies kept."""
    table = catalog.table(DUPLICATES)
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
    most every TABLE_TTL_S seconds, like the tables."""
    def listing() -> tuple:
        stamps = []
        for source in catalog.sources_of(MDS_SAMPLES):
            tree = catalog.mds_tree(source)
            if tree is not None:
                stamps += [(str(p), p.stat().st_mtime_ns) for p in sidecar_files(tree)]
        return tuple(stamps)

    return catalog.fresh("sidecar stamps", listing)


def skipped_sets(catalog: Catalog) -> dict[str, IdSet]:
    """Ids each skip reason removes, read back from the sidecars of every source's current
    MDS tree through its mapping table (the same files the loader reads)."""
    stamps = _sidecar_stamps(catalog)

    def compute() -> dict[str, IdSet]:
        ids: dict[str, set[str]] = {}
        for source in catalog.sources_of(MDS_SAMPLES):
            tree, mapping = catalog.mds_tree(source), catalog.table(MDS_SAMPLES, source)
            if tree is None or mapping is None:
                continue
            for sidecar in sidecar_files(tree):
                leaf = str(sidecar.parent.relative_to(tree))
                shard = sidecar.name.removesuffix(".skip.json") + ".mds"
                for reason, indices in read_sidecar(sidecar).items():
                    if not indices:
                        continue
                    rows = mapping.to_table(
                        columns=["id"], limit=min(len(indices), MAX_ID_SET),
                        filter=f"leaf = {sql_string(leaf)} AND shard = {sql_string(shard)} AND "
                               f"sample_index IN ({', '.join(str(int(i)) for i in indices)})")
                    ids.setdefault(reason, set()).update(rows.column("id").to_pylist())
        return {reason: IdSet.of(v) for reason, v in sorted(ids.items())}

    return catalog.cached(("skip", stamps), compute)


def corpus_filter(query: Query, sets: dict[str, dict[str, IdSet]] | None) -> str | None:
    """The Lance filter of the query's facets over the corpus table."""
    parts = []
    if query.source:
        parts.append(f"source = {sql_string(query.source)}")
    if query.label:
        parts.append(f"label = {sql_string(query.label)}")
    if query.tier is not None:
        parts.append(f"tier = {int(query.tier)}")
    if query.shape:
        width, height = SHAPE.match(query.shape).groups()
        parts.append(f"width = {int(width)} AND height = {int(height)}")
    if query.dup and sets is not None:
        dups = sets["dup"]
        if query.dup == "unique":
            members = sorted(dups["duplicate"].ids | dups["kept"].ids)
            if members:
                parts.append(f"NOT ({in_filter('id', members)})")
        else:
            parts.append(in_filter("id", dups[query.dup].array.to_pylist()))
    if query.skip and sets is not None:
        if query.skip == "any":
            skipped = sorted(set().union(*(s.ids for s in sets["skip"].values())))
        else:
            chosen = sets["skip"].get(query.skip)
            skipped = chosen.array.to_pylist() if chosen is not None else []
        parts.append(in_filter("id", skipped))
    return " AND ".join(parts) or None


# --------------------------------------------------------------------------------------- grid

@dataclass
class Grid:
    tiles: list[Tile]
    total: int  # matches (for a search: of its best MAX_SEARCH_HITS)
    page: int
    pages: int
    capped: bool = False  # a search with more matches than MAX_SEARCH_HITS
    facets: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    facets_partial: bool = False  # facet counts over the first MAX_FACET_ROWS matches


def _tiles(rows: pa.Table, score: str | None = None) -> list[Tile]:
    tiles = []
    for row in rows.to_pylist():
        caption = row.get("caption") or ""
        value = row.get(score) if score else None
        if score == "_distance" and value is not None:
            value = 1.0 - value  # cosine distance to similarity
        tiles.append(Tile(row["id"], row["source"], row.get("label"), row.get("tier"),
                          row.get("width"), row.get("height"),
                          caption if len(caption) <= CAPTION_CHARS
                          else caption[:CAPTION_CHARS - 1] + "…", value))
    return tiles


def _has_index(table: lance.LanceDataset, column: str) -> bool:
    return any(column in index.get("fields", []) for index in table.list_indices())


def grid(catalog: Catalog, query: Query, with_facets: bool = True) -> Grid:
    """One page of the grid for `query`, the number of matches and the facet counts."""
    table = catalog.corpus()
    sets = id_sets(catalog) if (query.dup or query.skip or with_facets) else None
    where = corpus_filter(query, sets)
    start = query.page * PAGE_SIZE
    if query.text or query.similar:
        hits = _ranked(table, query, where, FACET_COLUMNS + ["id", "caption"])
        total = hits.num_rows
        page_rows = hits.slice(start, PAGE_SIZE)
        score = "_score" if query.text else "_distance"
        tiles = _tiles(page_rows, score)
        capped = bool(query.text) and total >= MAX_SEARCH_HITS
        facet_rows = hits.select(FACET_COLUMNS + ["_rowaddr"]) if with_facets else None
    else:
        total = table.count_rows(filter=where) if where else table.count_rows()
        tiles = _tiles(table.to_table(columns=GRID_COLUMNS, filter=where, offset=start,
                                      limit=PAGE_SIZE))
        capped = False
        facet_rows = table.to_table(columns=FACET_COLUMNS, filter=where, limit=MAX_FACET_ROWS,
                                    with_row_address=True) if with_facets else None
    facets = (facet_counts(facet_rows, sets, membership(catalog, table, sets))
              if facet_rows is not None else {})
    partial = facet_rows is not None and facet_rows.num_rows < total
    return Grid(tiles, total, query.page, max(1, -(-total // PAGE_SIZE)), capped, facets,
                partial)


def _ranked(table: lance.LanceDataset, query: Query, where: str | None,
            columns: list[str]) -> pa.Table:
    """The best hits of a text search (BM25) or a more-like-this (cosine), best first."""
    if query.text:
        if not _has_index(table, "caption"):
            raise NotFound("the corpus has no full-text index on caption: rematerialise "
                           "`corpus`")
        return table.to_table(columns=columns + ["_score"], full_text_query=query.text,
                              filter=where, prefilter=where is not None, limit=MAX_SEARCH_HITS,
                              with_row_address=True)
    vector = table.to_table(columns=["embedding"], filter=f"id = {sql_string(query.similar)}",
                            limit=1)
    if vector.num_rows == 0:
        raise NotFound(f"no sample with id {query.similar!r} in the corpus")
    # Unfiltered first (the sample's own row is then the nearest), then facets applied.
    hits = table.to_table(
        columns=columns + ["_distance"], filter=where, prefilter=where is not None,
        nearest={"column": "embedding", "k": SIMILAR_K + 1, "metric": "cosine",
                 "q": np.asarray(vector.column("embedding")[0].as_py(), np.float32),
                 "nprobes": NPROBES, "refine_factor": REFINE_FACTOR},
        with_row_address=True)
    return hits.filter(pc.not_equal(hits.column("id"), query.similar))


class Membership:
    """Which rows of one corpus version belong to each facet id set, by row address
    (fragment id << 32 | offset): a boolean mask per fragment, built with one scan of the
    id column per corpus version and facet set, so counting a facet over the current
    matches reads no ids."""

    def __init__(self, masks: dict[tuple[str, str], dict[int, np.ndarray]]):
        self.masks = masks

    @classmethod
    def build(cls, table: lance.LanceDataset, sets: dict[str, dict[str, IdSet]],
              batch_rows: int = 1 << 18) -> "Membership":
        wanted = {(facet, value): ids for facet, values in sets.items()
                  for value, ids in values.items() if len(ids)}
        found: dict[tuple[str, str], list[np.ndarray]] = {key: [] for key in wanted}
        scanner = table.scanner(columns=["id"], with_row_address=True, batch_size=batch_rows)
        for batch in scanner.to_batches():
            addresses = batch.column("_rowaddr").to_numpy()
            for key, ids in wanted.items():
                hit = pc.fill_null(pc.is_in(batch.column("id"), value_set=ids.array), False)
                found[key].append(addresses[hit.to_numpy(zero_copy_only=False)])
        masks = {}
        for key, parts in found.items():
            addresses = np.concatenate(parts) if parts else np.empty(0, np.uint64)
            fragments, offsets = addresses >> np.uint64(32), addresses & np.uint64(0xFFFFFFFF)
            per_fragment = {}
            for fragment in np.unique(fragments):
                mine = offsets[fragments == fragment].astype(np.int64)
                mask = np.zeros(int(mine.max()) + 1, bool)
                mask[mine] = True
                per_fragment[int(fragment)] = mask
            masks[key] = per_fragment
        return cls(masks)

    def count(self, key: tuple[str, str], addresses: "RowAddresses") -> int:
        per_fragment = self.masks.get(key)
        if not per_fragment or addresses.size == 0:
            return 0
        total = 0
        for fragment, mask in per_fragment.items():
            mine = addresses.offsets_in(fragment)
            total += int(mask[mine[mine < mask.size]].sum())
        return total


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


def membership(catalog: Catalog, table: lance.LanceDataset,
               sets: dict[str, dict[str, IdSet]] | None) -> Membership | None:
    if sets is None:
        return None
    key = ("membership", table.uri, table.version,
           tuple((facet, value, len(ids), hash(ids.ids)) for facet, values in sets.items()
                 for value, ids in values.items()))
    return catalog.cached(key, lambda: Membership.build(table, sets))


def facet_counts(rows: pa.Table, sets: dict[str, dict[str, IdSet]] | None,
                 members: Membership | None = None) -> dict[str, list[tuple[str, int]]]:
    """Counts per value of each facet among `rows` (the current matches, with `_rowaddr`
    when `members` counts the duplicate and skip facets)."""
    # One grouping over every facet column at once (a few thousand groups at most), then
    # each facet's counts summed from the groups: one pass over the matches, not four.
    groups = rows.select(["source", "label", "tier", "width", "height"]).group_by(
        ["source", "label", "tier", "width", "height"]).aggregate([([], "count_all")])
    sums: dict[str, dict[str, int]] = {"source": {}, "label": {}, "tier": {}, "shape": {}}
    columns = {name: groups.column(name).to_pylist()
               for name in ("source", "label", "tier", "width", "height", "count_all")}
    for source, label, tier, width, height, n in zip(*columns.values()):
        for facet, value in (("source", source), ("label", label), ("tier", tier),
                             ("shape", f"{width}x{height}" if width and height else None)):
            if value is not None:
                sums[facet][str(value)] = sums[facet].get(str(value), 0) + n

    def ordered(facet: str) -> list[tuple[str, int]]:
        return sorted(sums[facet].items(), key=lambda p: (-p[1], p[0]))

    facets = {"source": ordered("source"), "label": ordered("label"),
              "tier": sorted(sums["tier"].items(), key=lambda p: int(p[0])),
              "shape": ordered("shape")}
    if sets is not None and members is not None:
        addresses = RowAddresses(rows.column("_rowaddr").to_numpy())
        dup_counts = {v: members.count(("dup", v), addresses) for v in ("duplicate", "kept")}
        dup_counts["unique"] = rows.num_rows - sum(dup_counts.values())
        facets["dup"] = [(v, n) for v, n in dup_counts.items() if n]
        skip = [(reason, members.count(("skip", reason), addresses)) for reason in sets["skip"]]
        facets["skip"] = [(r, n) for r, n in skip if n]
    return facets


# ------------------------------------------------------------------------------------- sample

@dataclass
class Sample:
    id: str
    row: dict  # the corpus row (no embedding, no thumbnail)
    image: dict | None  # bucketed_images: status, tier, shape, original size
    raw: dict | None  # raw_images: source_key, sha256, format, n_bytes, url
    captions: list[dict]  # every caption version of this sample
    labels: list[dict]  # every (caption version, classifier version) label row
    group: list[dict]  # its exact-duplicate group (kept copy marked), [] when unique
    near: list[dict]  # near duplicates: id and Hamming distance
    skips: list[dict]  # per shard: leaf, shard, index, reasons
    versions: dict[str, int | None]  # Lance version of each table read
    opt_outs: list[dict]  # audit rows naming this id


def _one(table: lance.LanceDataset | None, sample_id: str, columns: list[str],
         column: str = "id") -> dict | None:
    if table is None:
        return None
    present = [c for c in columns if c in table.schema.names]
    rows = table.to_table(columns=present, filter=f"{column} = {sql_string(sample_id)}", limit=1)
    return rows.to_pylist()[0] if rows.num_rows else None


def _all(table: lance.LanceDataset | None, where: str, columns: list[str], limit: int = 100
         ) -> list[dict]:
    if table is None:
        return []
    present = [c for c in columns if c in table.schema.names]
    return table.to_table(columns=present, filter=where, limit=limit).to_pylist()


def corpus_row(catalog: Catalog, sample_id: str, columns: list[str]) -> dict:
    row = _one(catalog.corpus(), valid_id(sample_id), columns)
    if row is None:
        raise NotFound(f"no sample with id {sample_id!r} in the corpus")
    return row


def sample(catalog: Catalog, sample_id: str) -> Sample:
    """Everything the pipeline knows about one sample, one bounded query per table."""
    corpus = catalog.corpus()
    row = corpus_row(catalog, sample_id, ["id", "source", "tier", "width", "height", "caption",
                                          "label", "phash"])
    source = row["source"]
    tables = {name: catalog.table(name, source) for name in
              (RAW_IMAGES, BUCKETED_IMAGES, CAPTIONS, CAPTION_LABELS, MDS_SAMPLES)}
    tables.update({DUPLICATES: catalog.table(DUPLICATES), OPT_OUTS: catalog.table(OPT_OUTS)})
    image = _one(tables[BUCKETED_IMAGES], sample_id,
                 ["status", "tier", "width", "height", "original_width", "original_height",
                  "error", "pixels", "flat"])
    raw = _one(tables[RAW_IMAGES], sample_id,
               ["source_key", "sha256", "format", "n_bytes", "width", "height", "url",
                "status"])
    where = f"id = {sql_string(sample_id)}"
    captions = sorted(_all(tables[CAPTIONS], where,
                           ["caption_version", "caption", "n_words", "model", "backend",
                            "status", "error", "created_at"]),
                      key=lambda c: str(c.get("created_at") or ""), reverse=True)
    labels = _all(tables[CAPTION_LABELS], where,
                  ["caption_version", "classifier_version", "label", "score_visual",
                   "score_text", "score_nsfw", "created_at"])
    group = exact_group(tables[DUPLICATES], sample_id)
    skips = skip_reasons(catalog, tables[MDS_SAMPLES], source, sample_id)
    opt_outs = _all(tables[OPT_OUTS], where, ["request_id", "key_type", "value", "reference",
                                                "requested_at", "via"])
    versions = {name: (t.version if t is not None else None)
                for name, t in [(CORPUS, corpus), *tables.items()]}
    return Sample(sample_id, row, image, raw, captions, labels, group,
                  near_duplicates_of(catalog, sample_id), skips, versions, opt_outs)


def exact_group(duplicates: lance.LanceDataset | None, sample_id: str) -> list[dict]:
    """Every member of the sample's exact-duplicate group, the kept copy first."""
    me = _one(duplicates, sample_id, ["kept_id", "phash", "group_size"])
    if me is None:
        return []
    members = _all(duplicates, f"kept_id = {sql_string(me['kept_id'])}",
                   ["id", "kept_id", "phash", "group_size"], limit=max(2, me["group_size"]))
    for member in members:
        member["kept"] = member["id"] == member["kept_id"]
    return sorted(members, key=lambda m: (not m["kept"], m["id"]))


def skip_reasons(catalog: Catalog, mapping: lance.LanceDataset | None, source: str,
                 sample_id: str) -> list[dict]:
    """Where the sample sits in its source's current shards and what each sidecar skips."""
    tree = catalog.mds_tree(source)
    places = _all(mapping, f"id = {sql_string(sample_id)}", ["leaf", "shard", "sample_index",
                                                          "tree_version"], limit=16)
    out = []
    for place in places:
        reasons = []
        if tree is not None:
            # The shard's location comes from the mapping table and the tree on disk (no
            # request input); a value that would leave the tree is ignored all the same.
            candidate = sidecar_path(tree / place["leaf"] / place["shard"])
            if candidate.resolve().is_relative_to(tree.resolve()):
                lists = read_sidecar(candidate)
                reasons = sorted(r for r, ids in lists.items() if place["sample_index"] in ids)
        out.append({**place, "reasons": reasons})
    return out


# --------------------------------------------------------------------------- near duplicates

def _popcount(values: np.ndarray) -> np.ndarray:
    """Set bits of each uint64."""
    as_bytes = values.view(np.uint8).reshape(-1, 8)
    return np.unpackbits(as_bytes, axis=1).sum(axis=1)


# Five bands cover 64 bits: hashes within Hamming distance 4 agree on at least one band
# (pigeonhole), so comparing hashes that share a band finds every such pair.
BANDS = ((0, 13), (13, 13), (26, 13), (39, 13), (52, 12))


def near_pairs(hashes: np.ndarray, max_distance: int = NEAR_MAX_DISTANCE,
               max_run: int = NEAR_MAX_RUN) -> list[tuple[int, int, int]]:
    """(i, j, distance) for distinct hashes i < j (indices into `hashes`, which must hold
    unique values) within 1..max_distance bits."""
    values = hashes.astype(np.int64).view(np.uint64)
    found: dict[tuple[int, int], int] = {}
    for shift, width in BANDS:
        band = (values >> np.uint64(shift)) & np.uint64((1 << width) - 1)
        order = np.argsort(band, kind="stable")
        sorted_band = band[order]
        for offset in range(1, max_run + 1):
            same = sorted_band[offset:] == sorted_band[:-offset]
            if not same.any():
                break
            left, right = order[:-offset][same], order[offset:][same]
            distance = _popcount(values[left] ^ values[right])
            close = (distance >= 1) & (distance <= max_distance)
            for a, b, d in zip(left[close], right[close], distance[close]):
                found[(min(a, b), max(a, b))] = int(d)
    return [(int(a), int(b), d) for (a, b), d in sorted(found.items())]


@dataclass
class NearCluster:
    members: list[dict]  # id, phash, source; grouped by identical hash
    max_distance: int


def near_clusters(catalog: Catalog, max_rows: int = NEAR_MAX_ROWS) -> list[NearCluster]:
    """Clusters of corpus images whose phashes differ by 1..4 bits (exact copies of one
    hash stay together), largest first; computed once per corpus version."""
    table = catalog.corpus()

    def compute() -> list[NearCluster]:
        rows = table.to_table(columns=["id", "source", "phash"], filter="phash IS NOT NULL",
                              limit=max_rows)
        hashes = rows.column("phash").to_numpy(zero_copy_only=False)
        unique, inverse = np.unique(hashes, return_inverse=True)
        pairs = near_pairs(unique)
        parent = list(range(len(unique)))

        def root(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        worst: dict[int, int] = {}
        for a, b, d in pairs:
            ra, rb = root(a), root(b)
            if ra != rb:
                parent[rb] = ra
        for a, _, d in pairs:
            worst[root(a)] = max(worst.get(root(a), 0), d)
        clusters: dict[int, list[dict]] = {}
        ids, sources = rows.column("id").to_pylist(), rows.column("source").to_pylist()
        for n, u in enumerate(inverse.tolist()):
            r = root(u)
            if r in worst:
                clusters.setdefault(r, []).append(
                    {"id": ids[n], "source": sources[n], "phash": int(hashes[n])})
        out = [NearCluster(sorted(m, key=lambda x: (x["phash"], x["id"])), worst[r])
               for r, m in clusters.items()]
        return sorted(out, key=lambda c: (-len(c.members), c.members[0]["id"]))

    return catalog.cached(("near", table.uri, table.version, max_rows), compute)


def near_duplicates_of(catalog: Catalog, sample_id: str) -> list[dict]:
    """The other members of the sample's near-duplicate cluster, with their distance."""
    clusters = near_clusters(catalog)
    table = catalog.corpus()
    index = catalog.cached(("near-index", table.uri, table.version), lambda: {
        m["id"]: cluster for cluster in clusters for m in cluster.members})
    cluster = index.get(sample_id)
    if cluster is None:
        return []
    mine = next(m for m in cluster.members if m["id"] == sample_id)
    return [{**m, "distance": int(_popcount(np.array([mine["phash"] ^ m["phash"]],
                                                     np.int64).view(np.uint64))[0])}
            for m in cluster.members if m["id"] != sample_id]


@dataclass
class ExactGroup:
    phash: int
    members: list[dict]  # id, kept


def exact_groups(catalog: Catalog, page: int = 0, per_page: int = 20) -> tuple[list[ExactGroup], int]:
    """A page of exact-duplicate groups (one query for the kept copies, one for members)."""
    table = catalog.table(DUPLICATES)
    if table is None:
        return [], 0
    kept_filter = "id = kept_id"
    total = table.count_rows(filter=kept_filter)
    kept = table.to_table(columns=["kept_id", "phash"], filter=kept_filter,
                          offset=page * per_page, limit=per_page)
    kept_ids = kept.column("kept_id").to_pylist()
    members = table.to_table(columns=["id", "kept_id", "phash"],
                             filter=in_filter("kept_id", kept_ids),
                             limit=max(1, per_page) * 1000).to_pylist()
    groups = []
    for kept_id, phash in zip(kept_ids, kept.column("phash").to_pylist()):
        mine = [{"id": m["id"], "kept": m["id"] == kept_id} for m in members
                if m["kept_id"] == kept_id]
        groups.append(ExactGroup(phash, sorted(mine, key=lambda m: (not m["kept"], m["id"]))))
    return groups, total


# ------------------------------------------------------------------------------------- blobs

def thumbnail(catalog: Catalog, sample_id: str) -> tuple[bytes, int]:
    """The corpus row's thumbnail JPEG and the corpus version it came from."""
    table = catalog.corpus()
    row = _one(table, valid_id(sample_id), ["thumbnail"])
    if row is None or not row["thumbnail"]:
        raise NotFound(f"no thumbnail for {sample_id!r}")
    return row["thumbnail"], table.version


def full_image(catalog: Catalog, sample_id: str) -> tuple[bytes, int]:
    """The bucketed JPEG of a corpus sample (its source is looked up, not parsed)."""
    source = corpus_row(catalog, sample_id, ["source"])["source"]
    table = catalog.table(BUCKETED_IMAGES, source)
    row = _one(table, sample_id, ["image"])
    if row is None or not row["image"]:
        raise NotFound(f"no bucketed image for {sample_id!r}")
    return row["image"], table.version


def random_id(catalog: Catalog, rng: np.random.Generator | None = None) -> str:
    table = catalog.corpus()
    rows = table.count_rows()
    if rows == 0:
        raise NotFound("the corpus is empty")
    offset = int((rng or np.random.default_rng()).integers(rows))
    return table.to_table(columns=["id"], offset=offset, limit=1).column("id")[0].as_py()


def overview(catalog: Catalog) -> dict:
    """Counts for the header: corpus rows and its version, sources present."""
    table = catalog.corpus()
    return {"rows": table.count_rows(), "version": table.version,
            "sources": catalog.sources_of(BUCKETED_IMAGES)}
