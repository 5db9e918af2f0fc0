"""What the corpus browser's views show, as Lance queries over the pipeline's own tables:
the grid (a page of the corpus, a caption search, more like this), a sample's page, the
duplicates, a random sample, the header's counts and the image bytes.

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
from prx_assets.browser.catalog import Catalog, NotFound, valid_id
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
from prx_assets.stages.corpus.search import NPROBES, REFINE_FACTOR
from prx_assets.stages.corpus.search import Hit as Tile
from prx_assets.stages.dedup import near
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
    SEMANTIC_DUPLICATES,
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
# Near-duplicate clusters are found among the first rows of the corpus' phash column.
NEAR_MAX_ROWS = 1_000_000
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


def fate(sample_id: str, sets: IdSets | None) -> tuple[str, str]:
    """What training does with one sample: ("removed", "removed: duplicate") for a copy
    dedup removed, ("skipped", "skipped: reason, ...") for one a skip list names, else
    ("trains", "trains")."""
    if sets is None:
        return ("trains", "trains")
    reasons = sorted(r for r, ids in sets["skip"].items() if sample_id in ids)
    if sample_id in sets["dup"]["duplicate"] or DEDUP_REASON in reasons:
        return ("removed", "removed: duplicate")
    if reasons:
        return ("skipped", "skipped: " + ", ".join(reasons))
    return ("trains", "trains")


def fate_counts(rows: int, sets: IdSets) -> dict[str, int]:
    """Of the corpus' `rows`: how many train, how many a skip list skips, how many are
    removed duplicates (each sample counted once, removal first)."""
    removed = set(sets["dup"]["duplicate"].ids) | set(
        sets["skip"].get(DEDUP_REASON, IdSet.of(())).ids)
    skipped = set().union(*(ids.ids for ids in sets["skip"].values())) - removed
    return {"trains": max(0, rows - len(removed) - len(skipped)), "skipped": len(skipped),
            "removed": len(removed)}


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
        tiles = _tiles(table.to_table(columns=GRID_COLUMNS, filter=where, offset=start,
                                      limit=PAGE_SIZE))
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
    own = _one(catalog.table(IMAGE_EMBEDDINGS, source), sample_id, ["encoder", "embedding"])
    if own is None:
        raise NotFound(f"no image embedding for {sample_id!r}: materialise "
                       "`image_embeddings` for its source")
    vector = np.asarray(own["embedding"], np.float32)
    found: list[pa.Table] = []
    for other in catalog.sources_of(IMAGE_EMBEDDINGS):
        vectors = catalog.table(IMAGE_EMBEDDINGS, other)
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
    rows = catalog.corpus().to_table(columns=GRID_COLUMNS, filter=pc.field("id").isin(wanted),
                                     limit=PAGE_SIZE)
    order = pc.sort_indices(pc.index_in(rows.column("id"), value_set=wanted))
    return _tiles(rows.take(order))


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
                          else caption[:CAPTION_CHARS - 1] + "…", value))
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


def _one(table: LanceDataset | None, sample_id: str, columns: list[str],
         column: str = "id") -> dict | None:
    if table is None:
        return None
    present = [c for c in columns if c in table.schema.names]
    rows = table.to_table(columns=present, filter=eq_filter(column, sample_id), limit=1)
    return rows.to_pylist()[0] if rows.num_rows else None


def _all(table: LanceDataset | None, where: str, columns: list[str], limit: int = 100
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
    where = eq_filter("id", sample_id)
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
                  near_duplicates_of(catalog, sample_id), skips, versions, opt_outs,
                  concepts.of_sample(catalog, sample_id))


def exact_group(duplicates: LanceDataset | None, sample_id: str) -> list[dict]:
    """Every member of the sample's exact-duplicate group, the kept copy first."""
    me = _one(duplicates, sample_id, ["kept_id", "phash", "group_size"])
    if me is None:
        return []
    members = _all(duplicates, eq_filter("kept_id", me["kept_id"]),
                   ["id", "kept_id", "phash", "group_size"], limit=max(2, me["group_size"]))
    for member in members:
        member["kept"] = member["id"] == member["kept_id"]
    return sorted(members, key=lambda m: (not m["kept"], m["id"]))


def skip_reasons(catalog: Catalog, mapping: LanceDataset | None, source: str,
                 sample_id: str) -> list[dict]:
    """Where the sample sits in its source's current shards and what each sidecar skips."""
    places = _all(mapping, eq_filter("id", sample_id),
                  ["leaf", "shard", "sample_index", "tree_version"], limit=16)
    out = []
    for place in places:
        sidecar = catalog.sidecar(source, place["leaf"], place["shard"])
        lists = sidecar.lists() if sidecar is not None else {}
        reasons = sorted(r for r, ids in lists.items() if place["sample_index"] in ids)
        out.append({**place, "reasons": reasons})
    return out


# -------------------------------------------------------------------------- duplicates

@dataclass
class SampleCluster:
    members: list[dict]  # id, source, phash; grouped by identical hash
    max_distance: int


def near_clusters(catalog: Catalog, max_rows: int = NEAR_MAX_ROWS) -> list[SampleCluster]:
    """Clusters of corpus images whose phashes differ by 1..4 bits (exact copies of one
    hash stay together), largest first; computed once per corpus version."""
    table = catalog.corpus()

    def compute() -> list[SampleCluster]:
        rows = table.to_table(columns=["id", "source", "phash"], filter="phash IS NOT NULL",
                              limit=max_rows)
        hashes = rows.column("phash").to_numpy(zero_copy_only=False)
        ids, sources = rows.column("id").to_pylist(), rows.column("source").to_pylist()
        return [SampleCluster([{"id": ids[i], "source": sources[i], "phash": int(hashes[i])}
                               for i in cluster.rows], cluster.max_distance)
                for cluster in near.near_clusters(hashes, ids)]

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
    return [{**m, "distance": near.hash_distance(mine["phash"], m["phash"])}
            for m in cluster.members if m["id"] != sample_id]


@dataclass
class ExactGroup:
    phash: int
    members: list[dict]  # id, kept, source, source_key, width, height, n_bytes, sha256
    byte_identical: bool = False  # every copy has the kept copy's bytes (sha256)
    why_kept: str = ""


def raw_facts(catalog: Catalog, ids: list[str]) -> dict[str, dict]:
    """Source key, original size, bytes and sha256 of each id, from its source's raw_images
    (one query per source; an id's source is the listed source its id starts with)."""
    by_source: dict[str, list[str]] = {}
    for source in catalog.sources_of(RAW_IMAGES):
        mine = [i for i in ids if i.startswith(f"{source}:")]
        if mine:
            by_source[source] = mine
    facts: dict[str, dict] = {}
    for source, mine in by_source.items():
        table = catalog.table(RAW_IMAGES, source)
        if table is None:
            continue
        rows = table.to_table(columns=["id", "source_key", "width", "height", "n_bytes",
                                       "sha256"],
                              filter=pc.field("id").isin(pa.array(mine, pa.string())),
                              limit=len(mine))
        facts.update({row["id"]: {**row, "source": source} for row in rows.to_pylist()})
    return facts


def why_kept(members: list[dict]) -> str:
    """Why dedup kept this copy (most pixels; ties: first source, then smallest id)."""
    kept = next(m for m in members if m["kept"])
    pixels = [(m.get("width") or 0) * (m.get("height") or 0) for m in members]
    mine = (kept.get("width") or 0) * (kept.get("height") or 0)
    if mine and pixels.count(mine) == 1 and mine == max(pixels):
        return f"kept: the most pixels ({kept['width']}x{kept['height']})"
    return "kept: as many pixels as another copy; the tie goes to the first source listed, " \
           "then the smallest id"


def exact_groups(catalog: Catalog, page: int = 0, per_page: int = 20
                 ) -> tuple[list[ExactGroup], int]:
    """A page of exact-duplicate groups (one query for the kept copies, one for members)."""
    table = catalog.table(DUPLICATES)
    if table is None:
        return [], 0
    kept_filter = "id = kept_id"
    total = table.count_rows(filter=kept_filter)
    kept = table.to_table(columns=["kept_id", "phash"], filter=kept_filter,
                          offset=page * per_page, limit=per_page)
    kept_ids = kept.column("kept_id").to_pylist()
    of_page = pc.field("kept_id").isin(kept.column("kept_id").combine_chunks())
    members = table.to_table(columns=["id", "kept_id", "phash"], filter=of_page,
                             limit=max(1, per_page) * 1000).to_pylist()
    facts = raw_facts(catalog, [m["id"] for m in members])
    groups = []
    for kept_id, phash in zip(kept_ids, kept.column("phash").to_pylist(), strict=True):
        mine = [{**facts.get(m["id"], {}), "id": m["id"], "kept": m["id"] == kept_id}
                for m in members if m["kept_id"] == kept_id]
        mine.sort(key=lambda m: (not m["kept"], m["id"]))
        shas = {m.get("sha256") for m in mine}
        groups.append(ExactGroup(phash, mine, len(shas) == 1 and None not in shas,
                                 why_kept(mine)))
    return groups, total


@dataclass
class SemanticGroup:
    members: list[dict]  # id, kept, similarity (cosine to the kept copy)


def semantic_groups(catalog: Catalog, page: int = 0, per_page: int = 20
                    ) -> tuple[list[SemanticGroup], int]:
    """A page of SemDeDup groups, largest first (the `semantic_duplicates` table)."""
    table = catalog.table(SEMANTIC_DUPLICATES)
    if table is None:
        return [], 0
    kept_filter = "id = kept_id"
    total = table.count_rows(filter=kept_filter)
    heads = table.to_table(columns=["kept_id", "group_size"], filter=kept_filter)
    order = pc.sort_indices(heads, [("group_size", "descending"), ("kept_id", "ascending")])
    kept = heads.take(order).slice(page * per_page, per_page).column("kept_id")
    of_page = pc.field("kept_id").isin(kept.combine_chunks())
    members = table.to_table(columns=["id", "kept_id", "similarity"], filter=of_page,
                             limit=max(1, per_page) * 1000).to_pylist()
    groups = []
    for kept_id in kept.to_pylist():
        mine = [{"id": m["id"], "kept": m["id"] == kept_id,
                 "similarity": round(float(m["similarity"]), 3)}
                for m in members if m["kept_id"] == kept_id]
        groups.append(SemanticGroup(sorted(mine, key=lambda m: (not m["kept"], m["id"]))))
    return groups, total


# ---------------------------------------------------------------------------------- blobs

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
