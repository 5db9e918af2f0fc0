"""Queries over the corpus table: full text on captions and nearest captions by embedding.

Kept free of Dagster and printing so that the CLI and, later, a web corpus browser share
them. Errors say what to do: build the corpus, pick a known id.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import lance
import numpy as np
import pyarrow as pa

from prx_assets.stages.attributes.schema import UNKNOWN, field_named
from prx_assets.storage.filters import all_of, eq_filter, in_filter, sql_string
from prx_assets.storage.object_store import ObjectStoreError
from prx_assets.storage.refs import TableRef

RESULT_COLUMNS = ["id", "source", "label", "tier", "width", "height", "caption"]
# Vector search settings: probe enough IVF partitions and re-rank PQ candidates on exact
# distances; bench/labels.py measures the recall these give.
NPROBES = 16
REFINE_FACTOR = 10


class SearchError(Exception):
    """A query that cannot be answered; the message says why."""


class CorpusNotBuilt(SearchError):
    pass


class EmptyCorpus(SearchError):
    pass


class UnknownId(SearchError):
    pass


@dataclass(frozen=True)
class Hit:
    id: str
    source: str
    label: str | None
    tier: int | None
    width: int | None
    height: int | None
    caption: str
    # BM25 for text search, cosine similarity for `similar`; None in a plain listing (the
    # corpus browser's grid shows its tiles as hits too).
    score: float | None = None
    # The training reservation read at ingest ("none", "constrained", "prohibited"; None
    # for a corpus built before reservations): the browser's `reserved` badge.
    reservation: str | None = None

    @property
    def reserved(self) -> bool:
        return self.reservation not in (None, "none")

    @property
    def shape(self) -> str:
        return f"{self.width}x{self.height}" if self.width and self.height else "?"


def open_corpus(corpus: TableRef) -> lance.LanceDataset:
    """The corpus table, refusing an absent or empty one, or an unreadable bucket, with what
    to do."""
    try:
        exists = corpus.exists()
    except ObjectStoreError as exc:  # missing bucket, refused credentials, dead endpoint
        raise SearchError(str(exc)) from exc
    if not exists:
        raise CorpusNotBuilt(f"no corpus table at {corpus}: materialise the `corpus` asset "
                             "first (e.g. `make demo`)")
    table = corpus.open()
    if table.count_rows() == 0:
        raise EmptyCorpus(f"the corpus table at {corpus} is empty: no source has labelled "
                          "captions yet")
    return table


def _filters(source: str | None, label: str | None, where: Sequence[str] = ()
             ) -> str | None:
    return all_of(eq_filter("source", source) if source else None,
                  eq_filter("label", label) if label else None,
                  *(attribute_filter(condition) for condition in where))


_CONDITION = re.compile(r"^\s*([a-z_]+)\s*(>=|<=|=)\s*(.+?)\s*$")


def attribute_filter(condition: str) -> str:
    """One attribute condition as Lance SQL: `medium=photo`, `medium=photo,painting` (any
    of), `subjects=animal` (holds it), `watermark=false`, `aesthetic_quality>=4`,
    `people=unknown` (the records that do not know it; a null never matches a value). Names and
    values are checked against the attribute schema, so nothing else reaches the SQL."""
    match = _CONDITION.match(condition)
    if not match:
        raise SearchError(f"bad attribute condition {condition!r}: write field=value, "
                          "field>=N or field<=N")
    name, op, text = match.groups()
    try:
        f = field_named(name)
    except KeyError as exc:
        raise SearchError(str(exc.args[0])) from None
    if f.kind == "integer":
        if not text.isdigit() or int(text) not in f.values:
            raise SearchError(f"{name}: {text!r} is not in {f.values[0]}..{f.values[-1]}")
        return f"{name} {op} {int(text)}"
    if op != "=":
        raise SearchError(f"{name} takes =, not {op}")
    values = [v.strip() for v in text.split(",")]
    if values == [UNKNOWN]:  # the records that do not know it (null), not "no"
        return f"{name} IS NULL"
    if f.kind == "boolean":
        if values[0] not in ("true", "false") or len(values) > 1:
            raise SearchError(f"{name}: true or false")
        return f"{name} = {values[0]}"
    unknown = [v for v in values if v not in f.values]
    if unknown:
        raise SearchError(f"{name}: {unknown} not among {list(f.values)} (or {UNKNOWN} "
                          "alone: the records that do not know it)")
    if f.kind == "enum_list":
        return "(" + " OR ".join(f"array_has({name}, {sql_string(v)})" for v in values) + ")"
    return in_filter(name, values)


def _has_index(table: lance.LanceDataset, column: str) -> bool:
    return any(column in index.get("fields", []) for index in table.list_indices())


def search_text(corpus: TableRef, text: str, k: int = 10, source: str | None = None,
                label: str | None = None, where: Sequence[str] = ()) -> list[Hit]:
    """Captions matching `text` (BM25 over the inverted index), best first."""
    if not text.strip():
        raise SearchError("empty query: give some words to search for")
    table = open_corpus(corpus)
    if not _has_index(table, "caption"):
        raise EmptyCorpus(f"the corpus at {corpus} has no full-text index on caption: "
                          "rematerialise `corpus`")
    result = table.to_table(columns=[*RESULT_COLUMNS, "_score"], full_text_query=text, limit=k,
                            filter=_filters(source, label, where), prefilter=True)
    return _hits(result, "_score")


def embedding_of(table: lance.LanceDataset, sample_id: str) -> np.ndarray:
    rows = table.to_table(columns=["embedding"], filter=eq_filter("id", sample_id), limit=1)
    if rows.num_rows == 0:
        raise UnknownId(f"no image with id {sample_id!r} in the corpus")
    return np.asarray(rows.column("embedding")[0].as_py(), dtype=np.float32)


def similar(corpus: TableRef, sample_id: str, k: int = 10, source: str | None = None,
            label: str | None = None, where: Sequence[str] = ()) -> list[Hit]:
    """The k captions nearest to `sample_id`'s (cosine), the image itself left out."""
    table = open_corpus(corpus)
    query = embedding_of(table, sample_id)
    result = nearest(table, query, k + 1, _filters(source, label, where))
    hits = [h for h in _hits(result, "_distance") if h.id != sample_id]
    return hits[:k]


def nearest(table: lance.LanceDataset, query: np.ndarray, k: int,
            filter: str | None = None) -> pa.Table:
    return table.to_table(
        columns=[*RESULT_COLUMNS, "_distance"], filter=filter, prefilter=filter is not None,
        nearest={"column": "embedding", "q": query, "k": k, "metric": "cosine",
                 "nprobes": NPROBES, "refine_factor": REFINE_FACTOR})


def _hits(result: pa.Table, score_column: str) -> list[Hit]:
    hits = []
    for row in result.to_pylist():
        score = float(row[score_column])
        if score_column == "_distance":
            score = 1.0 - score  # cosine distance -> similarity
        hits.append(Hit(row["id"], row["source"], row["label"], row["tier"], row["width"],
                        row["height"], row["caption"] or "", score))
    return hits


def format_hits(hits: list[Hit], caption_chars: int = 80) -> str:
    """One line per hit: id, source, label, shape, score and the start of the caption."""
    if not hits:
        return "no matches"
    lines = []
    for hit in hits:
        caption = hit.caption if len(hit.caption) <= caption_chars \
            else hit.caption[:caption_chars - 1] + "…"
        lines.append(f"{hit.id:<28} {hit.source:<12} {hit.label or '-':<7} {hit.shape:>9} "
                     f"{hit.score:7.3f}  {caption}")
    return "\n".join(lines)
