"""Concepts updated at the recorded hierarchy while the drift measure allows
(`spaces.incremental_concepts`)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prx_assets.stages.semantic.embeddings import write_embeddings
from prx_assets.stages.semantic.kmeans import normalise
from prx_assets.stages.semantic.spaces import (
    concepts_tag,
    incremental_concepts,
    read_fit,
    streamed_concepts,
)
from prx_assets.stages.semantic.streamed import DEFAULT_SAMPLE_ROWS, Tasks, space_inputs
from prx_assets.stages.semantic.synthetic import long_tailed_mixture
from prx_assets_tests.stages.semantic.test_streamed import ENCODER, SOURCES, write_space

LEVELS = (12, 3)


def fitted(tmp_path):
    vectors, topic = long_tailed_mixture(topics=20, largest=300, dim=16, seed=5)
    storage = write_space(tmp_path, vectors)
    inputs = space_inputs(storage, list(SOURCES), ENCODER)
    tag = concepts_tag(inputs, LEVELS, 0.5, 0, DEFAULT_SAMPLE_ROWS)
    out = storage.table("concepts")
    streamed_concepts(inputs, out, LEVELS, len(vectors) // 2, 0, Tasks(use_ray=False),
                      chunk_rows=111, tag=tag)
    return storage, vectors, topic, out


def add(storage, vectors: np.ndarray, first: int) -> list[str]:
    ids = [f"stock:{first + i:06d}" for i in range(len(vectors))]
    write_embeddings(storage.table("image_embeddings", "stock"),
                     [pa.table({"id": ids, "embedding": vectors.tolist()})], ENCODER, [])
    return ids


def update(storage, out):
    inputs = space_inputs(storage, list(SOURCES), ENCODER)
    tag = concepts_tag(inputs, LEVELS, 0.5, 0, DEFAULT_SAMPLE_ROWS)
    return incremental_concepts(inputs, out, tag, 0)


def test_rows_like_the_fits_are_assigned_to_the_recorded_leaves(tmp_path):
    storage, vectors, _, out = fitted(tmp_path)
    before = out.open().to_table()
    fit = read_fit(out, concepts_tag(space_inputs(storage, list(SOURCES), ENCODER), LEVELS,
                                     0.5, 0, DEFAULT_SAMPLE_ROWS))
    assert fit is not None
    rng = np.random.default_rng(1)
    like = normalise(vectors[rng.choice(len(vectors), 40)] + rng.normal(size=(40, 16)) * 0.01)
    ids = add(storage, like, 5000)
    result = update(storage, out)
    assert result is not None and result.run == "update" and result.new_rows == 40
    assert result.drift is not None and abs(result.drift) < 0.02
    after = out.open().to_table()
    assert after.num_rows == before.num_rows + 40 * len(LEVELS)  # appended, nothing rewritten
    new = after.filter(pc.is_in(after.column("id"), value_set=pa.array(ids)))
    leaves = new.filter(pc.equal(new.column("level"), 1)).sort_by("id")
    expected = (like @ fit.leaves.T).argmax(axis=1)
    assert np.array_equal(leaves.column("cluster").to_numpy(), expected)
    top = new.filter(pc.equal(new.column("level"), 2)).sort_by("id")
    assert np.array_equal(top.column("cluster").to_numpy(), fit.parents[0][expected])
    assert result.sizes[0].sum() == len(vectors) + 40
    version = out.open().version
    assert update(storage, out).new_rows == 0  # nothing since: nothing written
    assert out.open().version == version


def test_new_content_or_deleted_rows_refit(tmp_path):
    storage, _, _, out = fitted(tmp_path)
    elsewhere = normalise(np.random.default_rng(2).normal(size=(30, 16)))  # far from topics
    add(storage, elsewhere, 6000)
    assert update(storage, out) is None  # drifted: the caller refits
    storage, _, _, out = fitted(tmp_path / "again")
    storage.table("image_embeddings", "web").open().delete("id = 'web:000003'")
    assert update(storage, out) is None
