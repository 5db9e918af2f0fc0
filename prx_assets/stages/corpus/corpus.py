"""The corpus table: one Lance table across every source, for exploration and search.

A row per kept image (bucketed_images status "ok") that has a usable caption of the active
caption version and a label under the active (caption, classifier) versions: id, source,
tier, shape, caption, label, phash, caption embedding and a small JPEG thumbnail.

Built per source: the source's caption, label and phash columns (no image bytes) are joined
in memory by id (~2 KB a row: a 10M-image source needs ~20 GB on the driver; past that,
split the source), then the kept images stream through Ray, each batch looked up in that
join and thumbnailed.

Two ways to write it: `build_corpus` writes every source as one atomic Overwrite (the
previous corpus stays readable until the commit), compacted, then indexed from scratch;
`update_corpus` touches only the sources whose inputs changed, and of those only the rows
that differ (`delta.plan_delta`: new or changed rows written as uncommitted files in bounded
chunks, then ONE commit deleting the changed and departed rows and adding them:
`storage.replace.replace_where`); a row whose image is unchanged keeps its thumbnail. The
existing indexes are brought up to date with `optimize_indices` instead of retraining.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Literal

import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray.data
from PIL import Image

from prx_assets.engine.batches import arrow_batches, batch_fn
from prx_assets.models.embeddings import EMBEDDING_DIM
from prx_assets.stages.attributes.schema import fields as attribute_fields
from prx_assets.stages.corpus.delta import ROW_ADDRESS, SourceDelta, plan_delta
from prx_assets.stages.ingest.raw_rows import PROVENANCE_FIELDS
from prx_assets.storage.filters import all_of, eq_filter, in_filter
from prx_assets.storage.lance_tables import (
    FragmentPolicy,
    WriteReport,
    cleanup,
    compact,
    describe_write,
    write_dataset_atomically,
)
from prx_assets.storage.refs import TableRef
from prx_assets.storage.replace import replace_where, write_uncommitted

THUMB_SIDE = 256
THUMB_QUALITY = 85
# Below this many rows there is too little to train IVF centroids and PQ codebooks (256
# codes per sub-vector); Lance's exact flat search is fast at that size anyway.
MIN_ROWS_FOR_VECTOR_INDEX = 4096
PQ_SUB_VECTORS = 48  # 384 / 48 = 8 dimensions per code
CORPUS_FRAGMENTS = FragmentPolicy(target_bytes=1 << 30, max_rows=1 << 20)
CHUNK_ROWS = 16_384  # rows per append when a source is replaced (~30 KB each with thumbnail)
# Kept images per thumbnail batch (~8 ms each): short batches, so a task takes whole blocks
# of a few dozen rows and the last tasks of a source do not run alone for long.
THUMBNAIL_BATCH_ROWS = 32
# The indexes the corpus carries, by column (the vector one only past MIN_ROWS_FOR_VECTOR_INDEX).
SCALAR_INDEXES: dict[str, Literal["INVERTED", "BITMAP"]] = {
    "caption": "INVERTED", "source": "BITMAP", "label": "BITMAP", "tier": "BITMAP"}
VECTOR_INDEX = ("embedding", "IVF_PQ")

CORPUS_SCHEMA = pa.schema([
    pa.field("id", pa.string(), nullable=False),
    pa.field("source", pa.string(), nullable=False),
    pa.field("tier", pa.int32()),
    pa.field("width", pa.int32()),
    pa.field("height", pa.int32()),
    pa.field("caption", pa.string()),
    pa.field("label", pa.string()),
    pa.field("phash", pa.int64()),
    pa.field("embedding", pa.list_(pa.float32(), EMBEDDING_DIM)),
    pa.field("thumbnail", pa.binary()),
    # What the thumbnail was made from (`made_from`): an update keeps a row's thumbnail
    # while this is unchanged. Null where the bucketed row records no raw sha256.
    pa.field("made_from", pa.string()),
    # The active attribute record's typed columns (null without one) and where it came from.
    pa.field("attribute_origin", pa.string()),
    *(pa.field(f.name, f.arrow_type) for f in attribute_fields()),
    # Provenance and the training reservation read at ingest (raw_images; docs/rights.md).
    *PROVENANCE_FIELDS,
])
PROVENANCE_COLUMNS = [f.name for f in PROVENANCE_FIELDS]
ATTRIBUTE_COLUMNS = [f.name for f in attribute_fields()]
META_COLUMNS = ["caption", "label", "phash", "embedding", "attribute_origin", *ATTRIBUTE_COLUMNS,
                *PROVENANCE_COLUMNS]
SHAPE_COLUMNS = ["id", "source", "tier", "width", "height"]
# A corpus row without its thumbnail: what `expected_rows` computes on the driver.
ROW_SCHEMA = pa.schema([f for f in CORPUS_SCHEMA if f.name != "thumbnail"])
# Fragments an update leaves before compacting: each source replaced adds one, often of a
# few rows; compacting every time would rewrite the big fragments beside it for them.
MAX_FRAGMENTS = 16
# Thumbnails read back per Lance take when an update keeps them (~10 KB each).
THUMBNAIL_TAKE_ROWS = 1024
# The most ids one `id IN (...)` filter names (keeps the SQL bounded). An update deleting
# more replaces the source's rows whole (`source = ...`, thumbnails still carried); one
# making more thumbnails reads every kept image rather than those by id.
MAX_IN_IDS = 10_000


@dataclass(frozen=True)
class SourceTables:
    """Where one source's inputs live, the versions read (pinned once, so what is recorded
    as lineage is what was read), and which rows of them are active."""

    name: str
    bucketed: TableRef
    captions: TableRef
    labels: TableRef
    phashes: TableRef
    caption_filter: str
    labels_filter: str
    # The source's attribute records and the filter of the active ones (optional: a source
    # without attributes gets null attribute columns).
    attributes: TableRef | None = None
    attributes_filter: str | None = None
    # The source's raw_images, for provenance and reservations (optional: null columns).
    raw: TableRef | None = None

    def pinned(self) -> SourceTables:
        """Every input at its latest version now (what is read is what lineage records)."""
        attributes = self.attributes.pinned() if self.attributes is not None \
            and self.attributes.exists() else None
        raw = self.raw.pinned() if self.raw is not None and self.raw.exists() else None
        return replace(self, bucketed=self.bucketed.pinned(), captions=self.captions.pinned(),
                       labels=self.labels.pinned(), phashes=self.phashes.pinned(),
                       attributes=attributes, raw=raw)

    def versions(self) -> dict[str, int | None]:
        versions = {"bucketed": self.bucketed.version, "captions": self.captions.version,
                    "labels": self.labels.version, "phashes": self.phashes.version}
        if self.attributes is not None:
            versions["attributes"] = self.attributes.version
        if self.raw is not None:
            versions["raw"] = self.raw.version
        return versions


@dataclass
class CorpusReport:
    write: WriteReport
    rows_per_source: dict[str, int] = field(default_factory=dict)
    indexes: dict[str, str] = field(default_factory=dict)  # column -> index type or reason
    inserted: dict[str, int] = field(default_factory=dict)  # rows written, per source
    deleted: dict[str, int] = field(default_factory=dict)  # rows deleted, per source

    @property
    def processed(self) -> int:
        return sum(self.inserted.values())

    @property
    def removed(self) -> int:
        return sum(self.deleted.values())


def thumbnail(jpeg: bytes, side: int = THUMB_SIDE) -> bytes | None:
    """A JPEG whose longest side is at most `side` (None when the bytes do not decode)."""
    try:
        with Image.open(io.BytesIO(jpeg)) as img:
            img.draft("RGB", (side, side))  # decode at a reduced scale: much faster
            rgb = img.convert("RGB")
            rgb.thumbnail((side, side), Image.Resampling.LANCZOS)
            out = io.BytesIO()
            rgb.save(out, "JPEG", quality=THUMB_QUALITY)
            return out.getvalue()
    except (OSError, ValueError):
        return None


def _read(table: TableRef, columns: list[str], filter: str | None = None) -> pa.Table:
    try:
        return table.to_table(columns=columns, filter=filter)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"{table} cannot be read ({exc}): materialise it first") \
            from exc


def _lookup(ids: pa.Array, table: pa.Table, columns: list[str]) -> list[pa.Array]:
    """`columns` of `table` for each id (null where it has no row)."""
    positions = pc.index_in(ids, value_set=table.column("id"))
    return [table.column(c).combine_chunks().take(positions) for c in columns]


def made_from(bucketed: pa.Table) -> pa.ChunkedArray:
    """What a thumbnail is made from: the bucketed row's raw sha256 and the image stage's
    settings (which decide its bytes), and the thumbnail's side and quality."""
    return pc.binary_join_element_wise(bucketed.column("raw_sha256"), bucketed.column("settings"),
                                       f"thumb{THUMB_SIDE}q{THUMB_QUALITY}", "/")


def expected_rows(tables: SourceTables) -> pa.Table:
    """The source's corpus rows as they should be now, without thumbnails: each kept image
    with a usable caption and a label, its metadata joined by id (Arrow, on the driver)."""
    meta = source_metadata(tables)
    kept = _read(tables.bucketed, [*SHAPE_COLUMNS, "raw_sha256", "settings"], "status = 'ok'")
    rows = {c: kept.column(c) for c in SHAPE_COLUMNS}
    rows.update(zip(META_COLUMNS, _lookup(kept.column("id"), meta, META_COLUMNS), strict=True))
    rows["made_from"] = made_from(kept)
    table = pa.table(rows)
    return table.filter(pc.is_valid(table.column("label"))).select(ROW_SCHEMA.names) \
        .cast(ROW_SCHEMA)


def source_metadata(tables: SourceTables) -> pa.Table:
    """id, caption, label, phash, embedding of a source's labelled, captioned images."""
    labels = _read(tables.labels, ["id", "label", "embedding"], tables.labels_filter)
    captions = _read(tables.captions, ["id", "caption"], tables.caption_filter)
    phashes = _read(tables.phashes, ["id", "phash"])
    caption, = _lookup(labels.column("id"), captions, ["caption"])
    phash, = _lookup(labels.column("id"), phashes, ["phash"])
    meta = pa.table({"id": labels.column("id"), "caption": caption,
                     "label": labels.column("label"), "phash": phash,
                     "embedding": labels.column("embedding"),
                     **source_attributes(tables, labels.column("id")),
                     **source_provenance(tables, labels.column("id"))})
    return meta.filter(pc.is_valid(meta.column("caption")))


def source_attributes(tables: SourceTables, ids: pa.ChunkedArray) -> dict[str, pa.Array]:
    """The active attribute columns of `ids` (all null without an attributes table)."""
    columns = ["attribute_origin", *ATTRIBUTE_COLUMNS]
    if tables.attributes is None or not tables.attributes.exists():
        return {c: pa.nulls(len(ids), CORPUS_SCHEMA.field(c).type) for c in columns}
    records = _read(tables.attributes, ["id", "origin", *ATTRIBUTE_COLUMNS],
                    tables.attributes_filter).rename_columns(["id", *columns])
    return dict(zip(columns, _lookup(ids.combine_chunks(), records, columns), strict=True))


def source_provenance(tables: SourceTables, ids: pa.ChunkedArray) -> dict[str, pa.Array]:
    """Provenance and reservation of `ids` from raw_images (null without the table, or
    for a column a table of an older schema lacks)."""
    raw = tables.raw
    present = set(raw.open().schema.names) if raw is not None and raw.exists() else set()
    columns = [c for c in PROVENANCE_COLUMNS if c in present]
    found = dict(zip(columns, _lookup(ids.combine_chunks(), _read(raw, ["id", *columns]),
                                      columns), strict=True)) if raw is not None and columns \
        else {}
    return {c: found.get(c, pa.nulls(len(ids), pa.string())) for c in PROVENANCE_COLUMNS}


def thumbnailed(batch: pa.Table, expected: pa.Table) -> pa.Table:
    """Kept images (id, image) as corpus rows: their `expected` row and a new thumbnail;
    images without an expected row dropped (not decoded)."""
    at = pc.index_in(batch.column("id"), value_set=expected.column("id"))
    matched = pc.is_valid(at)
    rows = expected.take(at.filter(matched))
    images = batch.column("image").filter(matched).to_pylist()
    thumbnails = pa.array([thumbnail(b) if b else None for b in images], pa.binary())
    return rows.append_column("thumbnail", thumbnails).select(CORPUS_SCHEMA.names) \
        .cast(CORPUS_SCHEMA)


def thumbnail_dataset(tables: SourceTables, expected: pa.Table, by_id: bool) -> ray.data.Dataset:
    """The `expected` rows with new thumbnails, in Ray. `by_id`: read only their images
    (an `IN` filter: a few rows of a large source), else every kept image."""
    where = "status = 'ok'"
    if by_id:
        where = f"{where} AND {in_filter('id', expected.column('id').to_pylist())}"
    kept = tables.bucketed.read(columns=["id", "image"], filter=where)
    return kept.map_batches(batch_fn(thumbnailed), fn_kwargs={"expected": expected},
                            batch_format="pyarrow", batch_size=THUMBNAIL_BATCH_ROWS)


def source_dataset(tables: SourceTables) -> tuple[ray.data.Dataset, int]:
    expected = expected_rows(tables)
    return thumbnail_dataset(tables, expected, by_id=False), expected.num_rows


def build_corpus(corpus: TableRef, sources: list[SourceTables],
                 policy: FragmentPolicy = CORPUS_FRAGMENTS) -> CorpusReport:
    """Write the corpus table for `sources` (one new version), then index it."""
    datasets, expected = [], {}
    for tables in sources:
        dataset, n = source_dataset(tables)
        datasets.append(dataset)
        expected[tables.name] = n
    if not datasets:
        raise ValueError("no sources to build the corpus from")
    union = datasets[0].union(*datasets[1:]) if len(datasets) > 1 else datasets[0]
    corpus = corpus.latest()
    previous = corpus.count_rows() if corpus.exists() else 0
    write = write_dataset_atomically(union, corpus, policy, CORPUS_SCHEMA)
    report = CorpusReport(write, rows_per_source=count_by(corpus, "source"))
    report.inserted = dict(report.rows_per_source)
    report.deleted = {"(every source)": previous} if previous else {}
    report.indexes = create_indexes(corpus)
    return report


def update_corpus(corpus: TableRef, changed: list[SourceTables], gone: list[str],
                  keep: list[str], chunk_rows: int = CHUNK_ROWS,
                  policy: FragmentPolicy = CORPUS_FRAGMENTS, rebuild_indexes: bool = False,
                  on_rows: Callable[[int], None] | None = None) -> CorpusReport:
    """Replace the rows of the `changed` sources, delete those of the `gone` ones, keep the
    rows of `keep` as they are; then update the indexes (`rebuild_indexes`: retrain them).

    Each source's rows are replaced in one commit (`replace_source`): a reader, or a second
    run replacing the same source, sees the old rows or the new ones, never both and never
    neither. A run killed before a source's commit leaves that source as it was (its files
    written so far are orphans for cleanup); since the corpus records the input versions
    it read only once everything is written, the rerun finds the source changed again and
    redoes it. `on_rows(n)` is told of each chunk of `n` rows written (progress)."""
    corpus = corpus.latest()
    deleted = {name: delete_source(corpus, name) for name in gone}
    inserted: dict[str, int] = {}
    for tables in changed:
        inserted[tables.name], deleted[tables.name] = replace_source(corpus, tables, chunk_rows,
                                                                     on_rows)
    if any(inserted.values()) or any(deleted.values()):
        if len(corpus.open().get_fragments()) > MAX_FRAGMENTS:
            compact(corpus, policy)
        cleanup(corpus.open(), policy)
    rows_per_source = {name: corpus.count_rows(filter=eq_filter("source", name))
                       for name in [*keep, *(t.name for t in changed)]}
    indexes = create_indexes(corpus) if rebuild_indexes else update_indexes(corpus)
    return CorpusReport(describe_write(corpus.open()), rows_per_source, indexes, inserted, deleted)


def delete_source(corpus: TableRef, source: str) -> int:
    """Delete a source's rows in one commit; returns how many (no commit when none)."""
    where = eq_filter("source", source)
    if not corpus.latest().count_rows(filter=where):
        return 0
    return replace_where(corpus, where, [])[1]


def replace_source(corpus: TableRef, tables: SourceTables, chunk_rows: int,
                   on_rows: Callable[[int], None] | None = None) -> tuple[int, int]:
    """Bring a source's corpus rows up to date (`delta.plan_delta`): the rows that changed
    or are new written in chunks as uncommitted files, then one commit deleting the held
    rows that changed or left and adding them. Past MAX_IN_IDS ids to delete the source's
    rows are replaced whole. Returns (written, deleted); no commit when nothing changed."""
    corpus = corpus.pinned()  # the row addresses of the thumbnails kept are this version's
    expected = expected_rows(tables)
    source = eq_filter("source", tables.name)
    held = corpus.to_table(columns=ROW_SCHEMA.names, filter=source, with_row_address=True)
    delta = plan_delta(expected, held)
    if delta.empty:
        return 0, 0
    # The ids written are deleted too: a concurrent run that added them first loses them
    # to this commit rather than doubling them.
    replaced = pa.chunked_array([delta.delete, delta.write.column("id")]).to_pylist()
    where = all_of(source, in_filter("id", replaced)) or source
    if len(replaced) > MAX_IN_IDS:
        delta, where = plan_delta(expected, held, rewrite_all=True), source

    def chunks():
        for chunk in updated_rows(corpus, tables, delta, chunk_rows):
            yield chunk
            if on_rows:
                on_rows(chunk.num_rows)

    fragments, written = write_uncommitted(corpus, chunks(), CORPUS_SCHEMA, CORPUS_FRAGMENTS)
    _, deleted = replace_where(corpus, where, fragments)
    return written, deleted


def updated_rows(corpus: TableRef, tables: SourceTables, delta: SourceDelta,
                 chunk_rows: int) -> Iterator[pa.Table]:
    """The rows `delta` writes: first those keeping a held thumbnail (read back from the
    corpus version `corpus` pins, by row address), then those needing a new one (Ray)."""
    kept = delta.with_thumbnail_kept()
    dataset = corpus.open()
    for start in range(0, kept.num_rows, THUMBNAIL_TAKE_ROWS):
        part = kept.slice(start, THUMBNAIL_TAKE_ROWS)
        # By row address: the public `take` wants offsets, which deletions shift.
        thumbnails = dataset._take_rows(part.column(ROW_ADDRESS).combine_chunks(),
                                        columns=["thumbnail"]).column("thumbnail")
        yield part.drop_columns([ROW_ADDRESS]).append_column("thumbnail", thumbnails) \
            .select(CORPUS_SCHEMA.names).cast(CORPUS_SCHEMA)
    fresh = delta.needing_thumbnail()
    if fresh.num_rows:
        by_id = fresh.num_rows <= MAX_IN_IDS
        for chunk in arrow_batches(thumbnail_dataset(tables, fresh, by_id), batch_size=chunk_rows):
            if chunk.num_rows:
                yield chunk


def count_by(corpus: TableRef, column: str) -> dict[str, int]:
    values = corpus.to_table(columns=[column]).column(column)
    counts = pc.value_counts(values).to_pylist()
    return {str(c["values"]): int(c["counts"]) for c in counts}


def vector_index_partitions(rows: int) -> int:
    """IVF partitions: ~sqrt(rows) for large tables (31k at 1B rows), but at least ~2,048
    rows each, so training stays cheap and partitions full on small ones (48 at 100k)."""
    return int(max(1, min(int(np.sqrt(rows)), rows // 2048)))


def index_config() -> str:
    """A digest of how the indexes are built: a change means retraining, not updating."""
    spec = {"scalar": SCALAR_INDEXES, "vector": VECTOR_INDEX, "metric": "cosine",
            "sub_vectors": PQ_SUB_VECTORS, "min_rows": MIN_ROWS_FOR_VECTOR_INDEX}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]


def expected_indexes(rows: int) -> dict[str, str]:
    expected: dict[str, str] = dict(SCALAR_INDEXES)
    if rows >= MIN_ROWS_FOR_VECTOR_INDEX:
        expected[VECTOR_INDEX[0]] = VECTOR_INDEX[1]
    return expected


def present_indexes(table: lance.LanceDataset) -> dict[str, str]:
    """column -> index type of the indexes the table has (delta segments counted once)."""
    return {index["fields"][0]: str(index["type"]).upper() for index in table.list_indices()
            if len(index["fields"]) == 1}


def create_indexes(corpus: TableRef, columns: list[str] | None = None) -> dict[str, str]:
    """FTS on caption, bitmap indexes on source/label/tier, a vector index on embedding when
    the table is large enough to train one (else Lance's exact flat search is used);
    trained from scratch. `columns`: only those."""
    table = corpus.latest().open()
    built = {}
    rows = table.count_rows()
    if rows == 0:
        return {"all": "none (empty table)"}
    for column, kind in expected_indexes(rows).items():
        if columns is not None and column not in columns:
            continue
        if kind == VECTOR_INDEX[1]:
            table.create_index(column, index_type=kind, metric="cosine", replace=True,
                               num_partitions=vector_index_partitions(rows),
                               num_sub_vectors=PQ_SUB_VECTORS)
        else:
            table.create_scalar_index(column, index_type=SCALAR_INDEXES[column], replace=True)
        built[column] = kind
    if rows < MIN_ROWS_FOR_VECTOR_INDEX and (columns is None or VECTOR_INDEX[0] in columns):
        built[VECTOR_INDEX[0]] = \
            f"none: exact flat search below {MIN_ROWS_FOR_VECTOR_INDEX} rows"
    return built


def update_indexes(corpus: TableRef) -> dict[str, str]:
    """Add the rows written since to the existing indexes (`optimize_indices`: new data is
    assigned to the trained partitions and tokenised into the FTS index, no retraining);
    an index the table should have but lacks (the first past the vector-index threshold)
    is created."""
    table = corpus.latest().open()
    rows = table.count_rows()
    if rows == 0:
        return {"all": "none (empty table)"}
    present = present_indexes(table)
    missing = [c for c, kind in expected_indexes(rows).items() if present.get(c) != kind]
    if present:
        table.optimize.optimize_indices()
    report = {c: f"{kind} (updated)" for c, kind in present.items()}
    report.update(create_indexes(corpus, missing) if missing else {})
    if VECTOR_INDEX[0] not in present and rows < MIN_ROWS_FOR_VECTOR_INDEX:
        report[VECTOR_INDEX[0]] = f"none: exact flat search below {MIN_ROWS_FOR_VECTOR_INDEX} rows"
    return report
