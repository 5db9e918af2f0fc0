"""The browser's duplicate views: a sample's exact-duplicate group, near-duplicate
clusters of phashes, and pages of exact and semantic (SemDeDup) groups, as Lance queries
over the dedup tables. Every query projects its columns and carries a limit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc

from prx_assets.browser.catalog import Catalog
from prx_assets.browser.rows import one_row, rows_where
from prx_assets.stages.dedup import near
from prx_assets.storage.filters import eq_filter
from prx_assets.storage.tables import DUPLICATES, RAW_IMAGES, SEMANTIC_DUPLICATES

if TYPE_CHECKING:
    from lance import LanceDataset

# Near-duplicate clusters are found among the first rows of the corpus' phash column.
NEAR_MAX_ROWS = 1_000_000


def exact_group(duplicates: LanceDataset | None, sample_id: str) -> list[dict]:
    """Every member of the sample's exact-duplicate group, the kept copy first."""
    me = one_row(duplicates, sample_id, ["kept_id", "phash", "group_size"])
    if me is None:
        return []
    members = rows_where(duplicates, eq_filter("kept_id", me["kept_id"]),
                         ["id", "kept_id", "phash", "group_size"], limit=max(2, me["group_size"]))
    for member in members:
        member["kept"] = member["id"] == member["kept_id"]
    return sorted(members, key=lambda m: (not m["kept"], m["id"]))


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
        table = catalog.dataset(RAW_IMAGES, source)
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
    table = catalog.dataset(DUPLICATES)
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
    table = catalog.dataset(SEMANTIC_DUPLICATES)
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
