"""The global steps' input: every source's vectors of one encoder, with what the keep
policy needs (pixels from phashes, the source's rank in the sources file), pinned once so
what is recorded as lineage is what was read; and the `concepts` table's rows.

The vectors of every source are gathered on the driver (n x dim float32: 10^6 512-d
vectors are 2 GB); the k-means and the per-cluster steps then bound each task by the
cluster cap.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prx_assets.stages.semantic.concepts import ConceptTree
from prx_assets.stages.semantic.embeddings import read_space
from prx_assets.storage.layout import Storage
from prx_assets.storage.tables import IMAGE_EMBEDDINGS, PHASHES

CONCEPTS_SCHEMA = pa.schema([
    pa.field("id", pa.string(), nullable=False),
    pa.field("level", pa.int8(), nullable=False),  # 1 = leaves (finest)
    pa.field("cluster", pa.int32(), nullable=False),
    pa.field("balanced", pa.bool_(), nullable=False),  # kept by the balanced sample
])


@dataclass
class Space:
    ids: pa.Array
    vectors: np.ndarray
    pixels: np.ndarray
    rank: np.ndarray
    versions: dict[str, int] = field(default_factory=dict)  # input table -> version read
    missing: list[str] = field(default_factory=list)  # sources with no embeddings yet

    @property
    def rows(self) -> int:
        return len(self.ids)


def gather(storage: Storage, sources: list[str], encoder: str) -> Space:
    """Every source's rows of `encoder`, with pixels (0 where phashes has no row)."""
    ids: list[pa.Array] = []
    vectors: list[np.ndarray] = []
    pixels: list[np.ndarray] = []
    ranks: list[np.ndarray] = []
    space = Space(pa.array([], pa.string()), np.zeros((0, 1), np.float32), np.zeros(0),
                  np.zeros(0))
    for rank, source in enumerate(sources):
        table = storage.table(IMAGE_EMBEDDINGS, source)
        version = table.latest_version()
        if version is None:
            space.missing.append(source)
            continue
        table = table.at(version)
        space.versions[f"{IMAGE_EMBEDDINGS}/{source}"] = version
        source_ids, source_vectors = read_space(table, encoder)
        if not len(source_ids):
            continue
        ids.append(source_ids)
        vectors.append(source_vectors)
        pixels.append(_pixels(storage, source, source_ids, space))
        ranks.append(np.full(len(source_ids), rank, np.int32))
    if ids:
        dims = {v.shape[1] for v in vectors}
        if len(dims) > 1:
            raise ValueError(f"encoder {encoder!r} has vectors of several sizes: {sorted(dims)}")
        space.ids, space.vectors = pa.concat_arrays(ids), np.concatenate(vectors)
        space.pixels, space.rank = np.concatenate(pixels), np.concatenate(ranks)
    return space


def _pixels(storage: Storage, source: str, ids: pa.Array, space: Space) -> np.ndarray:
    hashes = storage.table(PHASHES, source)
    version = hashes.latest_version()
    if version is None:
        return np.zeros(len(ids), np.int64)
    hashes = hashes.at(version)
    space.versions[f"{PHASHES}/{source}"] = version
    table = hashes.to_table(columns=["id", "pixels"])
    positions = pc.index_in(ids, value_set=table.column("id"))
    found = pc.take(table.column("pixels"), positions)
    return np.asarray(pc.fill_null(found, 0).to_numpy(zero_copy_only=False), np.int64)


def concept_rows(ids: pa.Array, tree: ConceptTree, keep: np.ndarray) -> pa.Table:
    """One row per sample per level."""
    levels = len(tree.levels)
    n = len(ids)
    return pa.table({
        "id": pa.concat_arrays([ids] * levels) if n else pa.array([], pa.string()),
        "level": pa.array(np.repeat(np.arange(1, levels + 1), n).astype(np.int8)),
        "cluster": pa.array(np.concatenate(tree.levels).astype(np.int32)),
        "balanced": pa.array(np.tile(keep, levels)),
    }, schema=CONCEPTS_SCHEMA)
