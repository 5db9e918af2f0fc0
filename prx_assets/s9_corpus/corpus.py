"""The corpus table: one Lance table across every source, for exploration and search.

A row per kept image (bucketed_images status "ok") that has a usable caption of the active
caption version and a label under the active (caption, classifier) versions: id, source,
tier, shape, caption, label, phash, caption embedding and a small JPEG thumbnail.

Built per source: the source's caption, label and phash columns (no image bytes) are joined
in memory by id (~2 KB a row: a 10M-image source needs ~20 GB on the driver; past that,
split the source), then the kept images stream through Ray, each batch looked up in that
join and thumbnailed. The result is written as one atomic Overwrite (the previous corpus
stays readable until the commit), compacted, then indexed.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path

import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray.data
from PIL import Image

from prx_assets.models.embeddings import EMBEDDING_DIM
from prx_assets.storage.lance_tables import FragmentPolicy, WriteReport, write_dataset_atomically

THUMB_SIDE = 256
THUMB_QUALITY = 85
# Below this many rows there is too little to train IVF centroids and PQ codebooks (256
# codes per sub-vector); Lance's exact flat search is fast at that size anyway.
MIN_ROWS_FOR_VECTOR_INDEX = 4096
PQ_SUB_VECTORS = 48  # 384 / 48 = 8 dimensions per code
CORPUS_FRAGMENTS = FragmentPolicy(target_bytes=1 << 30, max_rows=1 << 20)

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
])
META_COLUMNS = ["caption", "label", "phash", "embedding"]
IMAGE_COLUMNS = ["id", "source", "tier", "width", "height", "image"]


@dataclass(frozen=True)
class SourceTables:
    """Where one source's inputs live, the versions read (pinned once, so what is recorded
    as lineage is what was read), and which rows of them are active."""

    name: str
    bucketed: str
    captions: str
    labels: str
    phashes: str
    caption_filter: str
    labels_filter: str
    bucketed_version: int | None = None
    captions_version: int | None = None
    labels_version: int | None = None
    phashes_version: int | None = None


@dataclass
class CorpusReport:
    write: WriteReport
    rows_per_source: dict[str, int] = field(default_factory=dict)
    indexes: dict[str, str] = field(default_factory=dict)  # column -> index type or reason


def thumbnail(jpeg: bytes, side: int = THUMB_SIDE) -> bytes | None:
    """A JPEG whose longest side is at most `side` (None when the bytes do not decode)."""
    try:
        with Image.open(io.BytesIO(jpeg)) as img:
            img.draft("RGB", (side, side))  # decode at a reduced scale: much faster
            img = img.convert("RGB")
            img.thumbnail((side, side), Image.LANCZOS)
            out = io.BytesIO()
            img.save(out, "JPEG", quality=THUMB_QUALITY)
            return out.getvalue()
    except (OSError, ValueError):
        return None


def _read(uri: str, version: int | None, columns: list[str], filter: str | None = None
          ) -> pa.Table:
    try:
        dataset = lance.dataset(str(uri), version=version)
    except (ValueError, FileNotFoundError, OSError) as exc:
        raise FileNotFoundError(f"{uri} cannot be read ({exc}): materialise it first") from exc
    return dataset.to_table(columns=columns, filter=filter)


def _lookup(ids: pa.Array, table: pa.Table, columns: list[str]) -> list[pa.Array]:
    """`columns` of `table` for each id (null where it has no row)."""
    positions = pc.index_in(ids, value_set=table.column("id"))
    return [table.column(c).take(positions) for c in columns]


def source_metadata(tables: SourceTables) -> pa.Table:
    """id, caption, label, phash, embedding of a source's labelled, captioned images."""
    labels = _read(tables.labels, tables.labels_version, ["id", "label", "embedding"],
                   tables.labels_filter)
    captions = _read(tables.captions, tables.captions_version, ["id", "caption"],
                     tables.caption_filter)
    phashes = _read(tables.phashes, tables.phashes_version, ["id", "phash"])
    caption, = _lookup(labels.column("id"), captions, ["caption"])
    phash, = _lookup(labels.column("id"), phashes, ["phash"])
    meta = pa.table({"id": labels.column("id"), "caption": caption,
                     "label": labels.column("label"), "phash": phash,
                     "embedding": labels.column("embedding")})
    return meta.filter(pc.is_valid(meta.column("caption")))


def corpus_batch(batch: pa.Table, meta: pa.Table) -> pa.Table:
    """Kept-image rows joined with the source's metadata, thumbnailed; unmatched dropped."""
    looked_up = dict(zip(META_COLUMNS, _lookup(batch.column("id"), meta, META_COLUMNS)))
    matched = pc.is_valid(looked_up["label"])
    rows = {c: batch.column(c).filter(matched) for c in IMAGE_COLUMNS if c != "image"}
    rows.update({c: looked_up[c].filter(matched) for c in META_COLUMNS})
    images = batch.column("image").filter(matched).to_pylist()
    rows["thumbnail"] = pa.array([thumbnail(b) if b else None for b in images], pa.binary())
    return pa.table(rows).select(CORPUS_SCHEMA.names).cast(CORPUS_SCHEMA)


def source_dataset(tables: SourceTables) -> tuple[ray.data.Dataset, int]:
    meta = source_metadata(tables)
    kept = ray.data.read_lance(str(tables.bucketed), version=tables.bucketed_version,
                               columns=IMAGE_COLUMNS, filter="status = 'ok'")
    dataset = kept.map_batches(corpus_batch, fn_kwargs={"meta": meta},
                               batch_format="pyarrow", batch_size=256)
    return dataset, meta.num_rows


def build_corpus(uri: Path, sources: list[SourceTables],
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
    write = write_dataset_atomically(union, uri, policy, CORPUS_SCHEMA)
    report = CorpusReport(write, rows_per_source=count_by(uri, "source"))
    report.indexes = create_indexes(uri)
    return report


def count_by(uri: Path, column: str) -> dict[str, int]:
    values = lance.dataset(str(uri)).to_table(columns=[column]).column(column)
    counts = pc.value_counts(values).to_pylist()
    return {str(c["values"]): int(c["counts"]) for c in counts}


def vector_index_partitions(rows: int) -> int:
    """IVF partitions: ~sqrt(rows) for large tables (31k at 1B rows), but at least ~2,048
    rows each, so training stays cheap and partitions full on small ones (48 at 100k)."""
    return int(max(1, min(int(np.sqrt(rows)), rows // 2048)))


def create_indexes(uri: Path) -> dict[str, str]:
    """FTS on caption, bitmap indexes on source/label/tier, a vector index on embedding when
    the table is large enough to train one (else Lance's exact flat search is used)."""
    table = lance.dataset(str(uri))
    built = {}
    rows = table.count_rows()
    if rows == 0:
        return {"all": "none (empty table)"}
    table.create_scalar_index("caption", index_type="INVERTED", replace=True)
    built["caption"] = "INVERTED"
    for column in ("source", "label", "tier"):
        table.create_scalar_index(column, index_type="BITMAP", replace=True)
        built[column] = "BITMAP"
    if rows >= MIN_ROWS_FOR_VECTOR_INDEX:
        table.create_index("embedding", index_type="IVF_PQ", metric="cosine", replace=True,
                           num_partitions=vector_index_partitions(rows),
                           num_sub_vectors=PQ_SUB_VECTORS)
        built["embedding"] = "IVF_PQ"
    else:
        built["embedding"] = f"none: exact flat search below {MIN_ROWS_FOR_VECTOR_INDEX} rows"
    return built
