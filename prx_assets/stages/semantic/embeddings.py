"""image_embeddings: one vector per kept image, per source, keyed by (id, encoder).

Two spaces:

- an image encoder (`VisionEncoder`): the vision tower of a CLIP or SigLIP checkpoint
  folder, loaded with transformers (the checkpoint is configuration, as the captioner's is),
  run on Ray Data actors over the source's kept images; tests use a tiny randomly
  initialised tower saved from a config;
- the caption space (no checkpoint configured): the MiniLM caption embeddings the labels
  stage already computed (real weights), copied per id. The demo runs on these, and the
  encoder name says so (`caption-minilm:<caption version>`).

Incremental like every stage: rows already embedded under the active encoder are reused,
new kept images are embedded, rows of images gone upstream are deleted; rows of other
encoders stay (several spaces can coexist, as caption versions do).
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray.data

from prx_assets.engine.batches import batch_fn
from prx_assets.models.embeddings import MODEL_ID
from prx_assets.storage.filters import all_of, eq_filter, in_filter
from prx_assets.storage.lance_tables import append_rows, overwrite_rows
from prx_assets.storage.refs import TableRef

CAPTION_ENCODER_PREFIX = "caption-minilm"
SCAN_ROWS = 1 << 16
DELETE_CHUNK = 4096
CLIP_TYPES = ("clip", "clip_vision_model")
SIGLIP_TYPES = ("siglip", "siglip_vision_model")


def embeddings_schema(dim: int) -> pa.Schema:
    return pa.schema([
        pa.field("id", pa.string(), nullable=False),
        pa.field("encoder", pa.string(), nullable=False),
        pa.field("embedding", pa.list_(pa.float32(), dim)),
    ])


def caption_encoder_name(caption_version: str) -> str:
    return f"{CAPTION_ENCODER_PREFIX}:{MODEL_ID}:{caption_version}"


def encoder_name(checkpoint: str | Path) -> str:
    """`<model type>:<folder name>:<hash of config and weights sizes>`: a new checkpoint in
    the same folder is a new encoder."""
    from transformers import AutoConfig

    folder = Path(checkpoint)
    config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    sizes = sorted((p.name, p.stat().st_size) for p in folder.iterdir() if p.is_file())
    digest = hashlib.sha256(repr((config.to_json_string(), sizes)).encode()).hexdigest()[:12]
    return f"{config.model_type}:{folder.name}:{digest}"


def unit_rows(vectors: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return (vectors / np.maximum(norms, 1e-12)).astype(np.float32)


def vector_column(vectors: np.ndarray) -> pa.FixedSizeListArray:
    vectors = np.ascontiguousarray(vectors, np.float32)
    return pa.FixedSizeListArray.from_arrays(pa.array(vectors.ravel()), vectors.shape[1])


class VisionEncoder:
    """A CLIP or SigLIP vision tower from a local folder: images to unit vectors (CPU, or
    the GPU when torch sees one). A Ray Data actor: `__call__` maps a batch of (id, image
    bytes) to (id, embedding, error); an image that does not decode gets an error, not a
    crash of the batch."""

    def __init__(self, checkpoint: str, threads: int = 1):
        import torch
        from transformers import (
            AutoConfig,
            AutoImageProcessor,
            CLIPVisionModelWithProjection,
            SiglipVisionModel,
        )

        if threads:
            torch.set_num_threads(threads)
        kind = AutoConfig.from_pretrained(checkpoint, local_files_only=True).model_type
        model_class: Any
        if kind in CLIP_TYPES:
            model_class = CLIPVisionModelWithProjection
        elif kind in SIGLIP_TYPES:
            model_class = SiglipVisionModel
        else:
            raise ValueError(f"{checkpoint}: model type {kind!r} is neither CLIP nor SigLIP")
        self._torch = torch
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model = model_class.from_pretrained(checkpoint, local_files_only=True).eval()
        self.model.to(self.device)
        self.processor = AutoImageProcessor.from_pretrained(checkpoint, local_files_only=True)
        self.clip = kind in CLIP_TYPES

    def embed(self, images: list) -> np.ndarray:
        pixels = self.processor(images=images, return_tensors="pt")["pixel_values"]
        with self._torch.inference_mode():
            out = self.model(pixel_values=pixels.to(self.device))
        pooled = out.image_embeds if self.clip else out.pooler_output
        return unit_rows(pooled.float().cpu().numpy())

    def __call__(self, batch: pa.Table) -> pa.Table:
        from PIL import Image

        images: list[Any] = []
        errors: list[str | None] = []
        for data in batch.column("image").to_pylist():
            try:
                with Image.open(io.BytesIO(data)) as img:
                    images.append(img.convert("RGB"))
                errors.append(None)
            except (OSError, ValueError, TypeError) as exc:
                images.append(None)
                errors.append(f"decode: {exc}")
        good = [img for img in images if img is not None]
        vectors = self.embed(good) if good else np.zeros((0, 1), np.float32)
        it = iter(vectors.tolist())
        rows = [next(it) if img is not None else None for img in images]
        return pa.table({"id": batch.column("id"), "embedding": pa.array(rows, pa.list_(
            pa.float32())), "error": pa.array(errors, pa.string())})


@dataclass(frozen=True)
class EmbeddingPlan:
    """What one run does: the ids to embed, those already embedded, those to delete."""

    todo: list[str]
    reused: int
    removed: list[str]


def plan(wanted: set[str], table: TableRef, encoder: str) -> EmbeddingPlan:
    done: set[str] = set()
    every: set[str] = set()
    if table.exists():
        scanner = table.open().scanner(columns=["id", "encoder"], batch_size=SCAN_ROWS)
        for batch in scanner.to_batches():
            ids = batch.column("id").to_pylist()
            every.update(ids)
            mine = pc.equal(batch.column("encoder"), encoder).to_pylist()
            done.update(i for i, m in zip(ids, mine, strict=True) if m)
    return EmbeddingPlan(sorted(wanted - done), len(done & wanted), sorted(every - wanted))


def kept_ids(bucketed: TableRef) -> set[str]:
    scanner = bucketed.open().scanner(columns=["id"], filter="status = 'ok'",
                                      batch_size=SCAN_ROWS)
    return {i for batch in scanner.to_batches() for i in batch.column("id").to_pylist()}


def caption_vectors(labels: TableRef, caption_version: str, ids: list[str]
                    ) -> Iterator[pa.Table]:
    """(id, embedding) of `ids` from caption_labels under the active caption version (the
    embedding depends on the caption alone, so any classifier version's row will do)."""
    wanted = pa.array(ids, pa.string())
    seen: set[str] = set()
    condition = all_of(eq_filter("caption_version", caption_version), "embedding IS NOT NULL")
    scanner = labels.open().scanner(columns=["id", "embedding"], filter=condition,
                                    batch_size=SCAN_ROWS)
    for batch in scanner.to_batches():
        table = pa.Table.from_batches([batch])
        table = table.filter(pc.is_in(table.column("id"), value_set=wanted))
        fresh = [i not in seen for i in table.column("id").to_pylist()]
        table = table.filter(pa.array(fresh, pa.bool_()))
        seen.update(table.column("id").to_pylist())
        if table.num_rows:
            yield table


def image_vectors(bucketed: TableRef, ids: list[str], checkpoint: str, actors: int = 1,
                  batch_size: int = 32, threads: int = 1) -> ray.data.Dataset:
    """The kept images among `ids` through `VisionEncoder` actors (at most `actors`)."""
    wanted = pa.array(ids, pa.string())
    images = bucketed.read(columns=["id", "image"], filter="status = 'ok'")
    pending = images.map_batches(batch_fn(_only), fn_kwargs={"wanted": wanted},
                                 batch_format="pyarrow")
    return pending.map_batches(
        VisionEncoder, fn_constructor_kwargs={"checkpoint": checkpoint, "threads": threads},
        batch_format="pyarrow", batch_size=batch_size, num_cpus=max(1, threads),
        compute=ray.data.ActorPoolStrategy(min_size=1, max_size=max(1, actors)))


def _only(batch: pa.Table, wanted: pa.Array) -> pa.Table:
    return batch.filter(pc.is_in(batch.column("id"), value_set=wanted))


@dataclass
class WriteCounts:
    written: int = 0
    failed: int = 0
    errors: list[str] | None = None
    dim: int | None = None
    replaced: bool = False  # the table held vectors of another size: replaced whole


def table_dim(table: TableRef) -> int | None:
    if not table.exists():
        return None
    return int(table.open().schema.field("embedding").type.list_size)


def write_embeddings(table: TableRef, batches: Iterable[pa.Table], encoder: str,
                     removed: list[str]) -> WriteCounts:
    """Delete the rows of `removed` ids, then append each batch of (id, embedding[, error])
    as unit vectors under `encoder` (one commit per batch: a killed run keeps what it
    committed and its rerun embeds only the rest). Failed rows are counted, not written.
    Encoders coexist in a table when their vectors have one size (a Lance vector column has
    one); an encoder of another size replaces the table with its first batch."""
    if removed and table.exists():
        dataset = table.open()
        for start in range(0, len(removed), DELETE_CHUNK):
            dataset.delete(in_filter("id", removed[start:start + DELETE_CHUNK]))
    counts = WriteCounts(errors=[])
    for batch in batches:
        if "error" in batch.column_names:
            bad = pc.is_valid(batch.column("error"))
            counts.failed += pc.sum(bad).as_py() or 0
            counts.errors = [*(counts.errors or []), *batch.column("error").filter(bad)
                             .to_pylist()][:5]
            batch = batch.filter(pc.invert(bad))
        if batch.num_rows == 0:
            continue
        vectors = np.asarray(batch.column("embedding").to_pylist(), np.float32)
        rows = pa.table({"id": batch.column("id"),
                         "encoder": pa.array([encoder] * batch.num_rows, pa.string()),
                         "embedding": vector_column(unit_rows(vectors))})
        if counts.dim is None and table_dim(table) not in (None, vectors.shape[1]):
            counts.replaced = True
            overwrite_rows(table, rows, embeddings_schema(vectors.shape[1]))
        else:
            append_rows(table, rows, embeddings_schema(vectors.shape[1]))
        counts.dim = vectors.shape[1]
        counts.written += batch.num_rows
    return counts


def read_space(table: TableRef, encoder: str) -> tuple[pa.Array, np.ndarray]:
    """(ids, unit vectors) of one encoder's rows, read in batches into one array."""
    ids: list[pa.Array] = []
    chunks: list[np.ndarray] = []
    scanner = table.open().scanner(columns=["id", "embedding"],
                                   filter=eq_filter("encoder", encoder), batch_size=SCAN_ROWS)
    for batch in scanner.to_batches():
        ids.append(batch.column("id"))
        flat = batch.column("embedding").combine_chunks() if isinstance(
            batch.column("embedding"), pa.ChunkedArray) else batch.column("embedding")
        dim = flat.type.list_size
        chunks.append(flat.flatten().to_numpy(zero_copy_only=False).reshape(-1, dim))
    if not ids:
        return pa.array([], pa.string()), np.zeros((0, 1), np.float32)
    return pa.concat_arrays(ids), np.concatenate(chunks).astype(np.float32)


# Below this many rows an exact scan is fast and IVF / PQ have too little to train on.
MIN_ROWS_FOR_VECTOR_INDEX = 4096


def index_vectors(table: TableRef) -> str:
    """An IVF_PQ cosine index on `embedding` (rebuilt whole), or why there is none."""
    dataset = table.open()
    rows = dataset.count_rows()
    if rows < MIN_ROWS_FOR_VECTOR_INDEX:
        return f"none: {rows} rows (< {MIN_ROWS_FOR_VECTOR_INDEX}, exact search)"
    dim = dataset.schema.field("embedding").type.list_size
    sub_vectors = next(s for s in (dim // 8, dim // 4, dim // 2, 1) if s and dim % s == 0)
    dataset.create_index("embedding", "IVF_PQ", metric="cosine", replace=True,
                         num_partitions=max(1, int(rows ** 0.5) // 4),
                         num_sub_vectors=sub_vectors)
    return "IVF_PQ (cosine)"
