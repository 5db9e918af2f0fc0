"""What the corpus browser's views show, as Lance queries over the pipeline's own tables:
the grid (a page of the corpus, a caption search, more like this), a sample's page (its
duplicates come from `duplicates`), a random sample, the header's counts and the image bytes.

No Dagster and no web framework here, so every view's data can be tested and benchmarked
on its own. Every query projects the columns it needs and carries a limit (or counts rows
without reading them); no view reads a whole table into memory. Tables come from the
`Catalog`, facet filters and counts from `facets`; a value that reaches a SQL filter is
one validated sample id, quoted by the storage layer's filter builder.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prx_assets.browser import concepts
from prx_assets.browser.catalog import Catalog, NotFound, applies_by_default, valid_id
from prx_assets.browser.duplicates import exact_group, near_duplicates_of
from prx_assets.browser.facets import (
    IdSet,
    IdSets,
    Query,
    corpus_filter,
    facet_columns,
    facet_counts,
    id_sets,
    membership,
)
from prx_assets.browser.rows import one_row, rows_where
from prx_assets.stages.corpus.search import NPROBES, REFINE_FACTOR
from prx_assets.stages.corpus.search import Hit as Tile
from prx_assets.storage.filters import eq_filter
from prx_assets.storage.tables import (
    BUCKETED_IMAGES,
    CAPTION_LABELS,
    CAPTIONS,
    CORPUS,
    DUPLICATES,
    IMAGE_EMBEDDINGS,
    MDS_SAMPLES,
    OPT_OUTS,
    RAW_IMAGES,
)

if TYPE_CHECKING:
    from lance import LanceDataset

PAGE_SIZE = 48
# A search's facet counts are over its best hits, not every match (BM25 needs a limit).
MAX_SEARCH_HITS = 1000
SIMILAR_K = 96
# Facet counts read the facet columns of at most this many matches (the page says when the
# counts cover only part of a larger match set).
MAX_FACET_ROWS = 1_000_000
CAPTION_CHARS = 140
GRID_COLUMNS = ["id", "source", "label", "tier", "width", "height", "caption"]


# ------------------------------------------------------------------------------------ grid

@dataclass
class Grid:
    tiles: list[Tile]
    total: int  # matches (for a search: of its best MAX_SEARCH_HITS)
    page: int
    pages: int
    capped: bool = False  # a search with more matches than MAX_SEARCH_HITS
    facets: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    facets_partial: bool = False  # facet counts over the first MAX_FACET_ROWS matches
    # tile id -> what happens to it in training: ("trains" | "skipped" | "removed", words)
    fates: dict[str, tuple[str, str]] = field(default_factory=dict)
    concept_level: int | None = None  # the level the `concept` facet counts (None: no table)
    concept_levels: list[int] = field(default_factory=list)


@dataclass
class ShapeGrid:
    """The shape facet as a grid: a row per tier, a column per aspect ratio (w/h), each
    cell the shape of that tier and aspect and its count among the matches."""

    aspects: list[float]
    rows: list[tuple[int, list[tuple[str, int] | None]]]


def shape_grid(tier_shapes: list[tuple[str, int]]) -> ShapeGrid:
    """From the `tier_shape` facet ("512:608x432", count)."""
    cells: dict[tuple[int, float], tuple[str, int]] = {}
    for key, count in tier_shapes:
        tier, shape = key.split(":")
        width, height = shape.split("x")
        cells[(int(tier), round(int(width) / int(height), 2))] = (shape, count)
    aspects = sorted({aspect for _, aspect in cells})
    tiers = sorted({tier for tier, _ in cells})
    return ShapeGrid(aspects, [(tier, [cells.get((tier, a)) for a in aspects]) for tier in tiers])


# The skip reason under which exact-duplicate copies leave the shards (dedup's skip list).
DEDUP_REASON = "dedup"


def opt_in_words(reasons: list[str]) -> str:
    """"in the balance list, opt-in": lists the loader applies only when a run names them."""
    if not reasons:
        return ""
    lists = "list" if len(reasons) == 1 else "lists"
    return f"in the {', '.join(reasons)} {lists}, opt-in"


def fate(sample_id: str, sets: IdSets | None) -> tuple[str, str]:
    """What training does by default with one sample: ("removed", "removed: duplicate") for
    a copy dedup removed, ("skipped", "skipped: reason, ...") for one a default skip list
    names, else ("trains", "trains"), with the opt-in lists that name it said beside
    ("trains · in the balance list, opt-in"): the loader skips those only when asked."""
    if sets is None:
        return ("trains", "trains")
    reasons = sorted(r for r, ids in sets["skip"].items() if sample_id in ids)
    applied = [r for r in reasons if applies_by_default(r)]
    if sample_id in sets["dup"]["duplicate"] or DEDUP_REASON in applied:
        return ("removed", "removed: duplicate")
    if applied:
        return ("skipped", "skipped: " + ", ".join(applied))
    opt_in = [r for r in reasons if not applies_by_default(r)]
    return ("trains", " · ".join(["trains", *([opt_in_words(opt_in)] if opt_in else [])]))


def fate_counts(rows: int, sets: IdSets) -> dict:
    """Of the corpus' `rows`: how many train, how many a default skip list skips, how many
    are removed duplicates (each sample counted once, removal first), as the loader does
    when a run names no reasons; and `opt_in`: the samples of each opt-in list."""
    removed = set(sets["dup"]["duplicate"].ids) | set(
        sets["skip"].get(DEDUP_REASON, IdSet.of(())).ids)
    skipped = set().union(*(ids.ids for reason, ids in sets["skip"].items()
                            if applies_by_default(reason))) - removed
    opt_in = {reason: len(ids.ids) for reason, ids in sets["skip"].items()
              if not applies_by_default(reason)}
    return {"trains": max(0, rows - len(removed) - len(skipped)), "skipped": len(skipped),
            "removed": len(removed), "opt_in": opt_in}


def grid(catalog: Catalog, query: Query, with_facets: bool = True) -> Grid:
    """One page of the grid for `query`, the number of matches and the facet counts."""
    table = catalog.corpus()
    sets = id_sets(catalog) if (query.dup or query.skip or with_facets) else None
    where = _with_concept(catalog, query, corpus_filter(query, sets))
    levels = concepts.levels(catalog)
    start = query.page * PAGE_SIZE
    facet_rows: pa.Table | None = None
    columns = [*facet_columns(table), *(["id"] if levels else [])]
    if query.text or query.similar:
        hits = _ranked(catalog, table, query, where,
                       list(dict.fromkeys([*columns, "id", "caption"])))
        total = hits.num_rows
        tiles = _tiles(hits.slice(start, PAGE_SIZE), "_score" if query.text else "_distance")
        capped = bool(query.text) and total >= MAX_SEARCH_HITS
        if with_facets:
            facet_rows = hits.select([*columns, "_rowaddr"])
    else:
        total = table.count_rows(filter=where)
        tiles = _tiles(table.to_table(columns=_grid_columns(table), filter=where,
                                      offset=start, limit=PAGE_SIZE))
        capped = False
        if with_facets:
            facet_rows = table.to_table(columns=columns, filter=where, limit=MAX_FACET_ROWS,
                                        with_row_address=True)
    facets = ({} if facet_rows is None else
              facet_counts(facet_rows, sets, membership(catalog, table, sets)))
    level = _concept_level(query, levels)
    if facet_rows is not None and level is not None:
        everything = not (query.filtered or query.text or query.similar)
        facets["concept"] = concepts.cluster_counts(
            catalog, level, None if everything else facet_rows.column("id").combine_chunks())
    partial = facet_rows is not None and facet_rows.num_rows < total
    return Grid(tiles, total, query.page, max(1, -(-total // PAGE_SIZE)), capped, facets,
                partial, {tile.id: fate(tile.id, sets) for tile in tiles}, level, levels)


def _concept_level(query: Query, levels: list[int]) -> int | None:
    """The level the concept facet counts: the chosen one, else the top (fewest clusters)."""
    if not levels:
        return None
    return query.level if query.level in levels else levels[-1]


def _with_concept(catalog: Catalog, query: Query, where: pc.Expression | None
                  ) -> pc.Expression | None:
    """The facets' filter and, when a concept is chosen, its members."""
    if query.concept is None or query.level is None:
        return where
    chosen = pc.field("id").isin(concepts.members(catalog, query.level, query.concept).array)
    return chosen if where is None else where & chosen


def _ranked(catalog: Catalog, table: LanceDataset, query: Query,
            where: pc.Expression | None, columns: list[str]) -> pa.Table:
    """The best hits of a text search (BM25) or a more-like-this (cosine), best first; the
    facets' filter is applied before ranking."""
    if query.text:
        if not _has_index(table, "caption"):
            raise NotFound("the corpus has no full-text index on caption: rematerialise "
                           "`corpus`")
        return table.to_table(columns=[*columns, "_score"], full_text_query=query.text,
                              filter=where, prefilter=where is not None, limit=MAX_SEARCH_HITS,
                              with_row_address=True)
    if query.space == "image":
        return _image_neighbours(catalog, table, query.similar, where, columns)
    vector = table.to_table(columns=["embedding"], filter=eq_filter("id", query.similar),
                            limit=1)
    if vector.num_rows == 0:
        raise NotFound(f"no sample with id {query.similar!r} in the corpus")
    # Unfiltered first (the sample's own row is then the nearest), then facets applied.
    hits = table.to_table(
        columns=[*columns, "_distance"], filter=where, prefilter=where is not None,
        nearest={"column": "embedding", "k": SIMILAR_K + 1, "metric": "cosine",
                 "q": np.asarray(vector.column("embedding")[0].as_py(), np.float32),
                 "nprobes": NPROBES, "refine_factor": REFINE_FACTOR},
        with_row_address=True)
    return hits.filter(pc.not_equal(hits.column("id"), query.similar))


def _image_neighbours(catalog: Catalog, table: LanceDataset, sample_id: str,
                      where: pc.Expression | None, columns: list[str]) -> pa.Table:
    """More like this in image space: the SIMILAR_K nearest image_embeddings vectors of the
    sample's encoder across every source (each source's search uses its ANN index when it
    has one, else an exact scan capped at k), then the corpus rows the facets keep."""
    source = corpus_row(catalog, sample_id, ["source"])["source"]
    own = one_row(catalog.dataset(IMAGE_EMBEDDINGS, source), sample_id, ["encoder", "embedding"])
    if own is None:
        raise NotFound(f"no image embedding for {sample_id!r}: materialise "
                       "`image_embeddings` for its source")
    vector = np.asarray(own["embedding"], np.float32)
    found: list[pa.Table] = []
    for other in catalog.sources_of(IMAGE_EMBEDDINGS):
        vectors = catalog.dataset(IMAGE_EMBEDDINGS, other)
        if vectors is None:
            continue
        encoder = eq_filter("encoder", own["encoder"])
        found.append(vectors.to_table(
            columns=["id", "_distance"], filter=encoder, prefilter=True,
            nearest={"column": "embedding", "k": SIMILAR_K + 1, "metric": "cosine",
                     "q": vector, "nprobes": NPROBES, "refine_factor": REFINE_FACTOR}))
    nearest = pa.concat_tables(found).sort_by("_distance").slice(0, SIMILAR_K + 1)
    nearest = nearest.filter(pc.not_equal(nearest.column("id"), sample_id))
    chosen = pc.field("id").isin(nearest.column("id").combine_chunks())
    rows = table.to_table(columns=columns, filter=chosen if where is None else where & chosen,
                          limit=SIMILAR_K, with_row_address=True)
    at = pc.index_in(rows.column("id"), value_set=nearest.column("id"))
    rows = rows.append_column("_distance", pc.take(nearest.column("_distance"), at))
    return rows.sort_by("_distance")


def tiles_of(catalog: Catalog, ids: list[str]) -> list[Tile]:
    """Grid tiles of these corpus samples (at most PAGE_SIZE), in the order given."""
    wanted = pa.array(ids[:PAGE_SIZE], pa.string())
    corpus = catalog.corpus()
    rows = corpus.to_table(columns=_grid_columns(corpus), filter=pc.field("id").isin(wanted),
                           limit=PAGE_SIZE)
    order = pc.sort_indices(pc.index_in(rows.column("id"), value_set=wanted))
    return _tiles(rows.take(order))


def _grid_columns(table: LanceDataset) -> list[str]:
    """A tile's columns, with its reservation where the corpus has one."""
    return [*GRID_COLUMNS, *(["reservation"] if "reservation" in table.schema.names else [])]


def _has_index(table: LanceDataset, column: str) -> bool:
    return any(column in index.get("fields", []) for index in table.list_indices())


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
                          else caption[:CAPTION_CHARS - 1] + "…", value,
                          row.get("reservation")))
    return tiles


# ---------------------------------------------------------------------------------- sample

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
    concepts: list[dict] = field(default_factory=list)  # level, cluster


def corpus_row(catalog: Catalog, sample_id: str, columns: list[str]) -> dict:
    row = one_row(catalog.corpus(), valid_id(sample_id), columns)
    if row is None:
        raise NotFound(f"no sample with id {sample_id!r} in the corpus")
    return row


def sample(catalog: Catalog, sample_id: str) -> Sample:
    """Everything the pipeline knows about one sample, one bounded query per table."""
    corpus = catalog.corpus()
    row = corpus_row(catalog, sample_id, ["id", "source", "tier", "width", "height", "caption",
                                          "label", "phash", "reservation"])
    source = row["source"]
    tables = {name: catalog.dataset(name, source) for name in
              (RAW_IMAGES, BUCKETED_IMAGES, CAPTIONS, CAPTION_LABELS, MDS_SAMPLES)}
    tables.update({DUPLICATES: catalog.dataset(DUPLICATES), OPT_OUTS: catalog.dataset(OPT_OUTS)})
    image = one_row(tables[BUCKETED_IMAGES], sample_id,
                   ["status", "tier", "width", "height", "original_width", "original_height",
                    "error", "pixels", "flat"])
    raw = one_row(tables[RAW_IMAGES], sample_id,
                 ["source_key", "sha256", "format", "n_bytes", "width", "height", "url",
                  "status", "license", "license_url", "attribution", "reservation",
                  "reservation_signal"])
    where = eq_filter("id", sample_id)
    captions = sorted(rows_where(tables[CAPTIONS], where,
                                 ["caption_version", "caption", "n_words", "model", "backend",
                                  "status", "error", "created_at"]),
                      key=lambda c: str(c.get("created_at") or ""), reverse=True)
    labels = rows_where(tables[CAPTION_LABELS], where,
                        ["caption_version", "classifier_version", "label", "score_visual",
                         "score_text", "score_nsfw", "created_at"])
    group = exact_group(tables[DUPLICATES], sample_id)
    skips = skip_reasons(catalog, tables[MDS_SAMPLES], source, sample_id)
    opt_outs = rows_where(tables[OPT_OUTS], where, ["request_id", "key_type", "value", "reference",
                                                      "requested_at", "via"])
    versions = {name: (t.version if t is not None else None)
                for name, t in [(CORPUS, corpus), *tables.items()]}
    return Sample(sample_id, row, image, raw, captions, labels, group,
                  near_duplicates_of(catalog, sample_id), skips, versions, opt_outs,
                  concepts.of_sample(catalog, sample_id))


def skip_reasons(catalog: Catalog, mapping: LanceDataset | None, source: str,
                 sample_id: str) -> list[dict]:
    """Where the sample sits in its source's current shards, what each sidecar skips by
    default (`reasons`) and the opt-in lists that name it, in words (`opt_in`)."""
    places = rows_where(mapping, eq_filter("id", sample_id),
                        ["leaf", "shard", "sample_index", "tree_version"], limit=16)
    out = []
    for place in places:
        sidecar = catalog.sidecar(source, place["leaf"], place["shard"])
        lists = sidecar.lists() if sidecar is not None else {}
        named = sorted(r for r, ids in lists.items() if place["sample_index"] in ids)
        out.append({**place, "reasons": [r for r in named if applies_by_default(r)],
                    "opt_in": opt_in_words([r for r in named if not applies_by_default(r)])})
    return out


# ---------------------------------------------------------------------------------- blobs

def thumbnail(catalog: Catalog, sample_id: str) -> tuple[bytes, int]:
    """The corpus row's thumbnail JPEG and the corpus version it came from."""
    table = catalog.corpus()
    row = one_row(table, valid_id(sample_id), ["thumbnail"])
    if row is None or not row["thumbnail"]:
        raise NotFound(f"no thumbnail for {sample_id!r}")
    return row["thumbnail"], table.version


def full_image(catalog: Catalog, sample_id: str) -> tuple[bytes, int]:
    """The bucketed JPEG of a corpus sample (its source is looked up, not parsed)."""
    source = corpus_row(catalog, sample_id, ["source"])["source"]
    table = catalog.dataset(BUCKETED_IMAGES, source)
    row = one_row(table, sample_id, ["image"])
    if table is None or row is None or not row["image"]:
        raise NotFound(f"no bucketed image for {sample_id!r}")
    return row["image"], table.version


# ------------------------------------------------------------------------------ overview

def random_id(catalog: Catalog, rng: np.random.Generator | None = None) -> str:
    table = catalog.corpus()
    rows = table.count_rows()
    if rows == 0:
        raise NotFound("the corpus is empty")
    offset = int((rng or np.random.default_rng()).integers(rows))
    return table.to_table(columns=["id"], offset=offset, limit=1).column("id")[0].as_py()


def overview(catalog: Catalog) -> dict:
    """Counts for the header: corpus rows and its version, sources present, and how many
    of the rows train, are skipped or are removed duplicates."""
    table = catalog.corpus()
    rows = table.count_rows()
    return {"rows": rows, "version": table.version,
            "sources": catalog.sources_of(BUCKETED_IMAGES),
            "fates": fate_counts(rows, id_sets(catalog))}
