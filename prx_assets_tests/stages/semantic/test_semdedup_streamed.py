"""SemDeDup's tables killed between their commits (`semdedup_streamed`): the rerun leaves
them as a full recompute at the recorded fit would, without copies."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from prx_assets.stages.semantic.embeddings import write_embeddings
from prx_assets.stages.semantic.semdedup import SemDedupConfig
from prx_assets.stages.semantic.semdedup_streamed import (
    fit_tag,
    read_fit,
    streamed_semantic_duplicates,
)
from prx_assets.stages.semantic.semdedup_update import incremental_semantic_duplicates
from prx_assets.stages.semantic.streamed import DEFAULT_SAMPLE_ROWS, Tasks, space_inputs
from prx_assets.stages.semantic.synthetic import planted_duplicates
from prx_assets.storage.layout import Storage
from prx_assets.testing.tree_writers import kill_held_at
from prx_assets_tests.stages.semantic.test_streamed import (
    ENCODER,
    SOURCES,
    groups_at_fit,
    space_ids,
    write_space,
)

CONFIG = SemDedupConfig(cluster_rows=50, cluster_cap=10_000)
_RUN = """
import sys
from prx_assets.storage.layout import Storage
from prx_assets_tests.stages.semantic.test_semdedup_streamed import run
run(Storage(sys.argv[1]), full=sys.argv[2] == "full")
"""


def run(storage: Storage, full: bool = False) -> None:
    """As the asset runs it: an update at the recorded fit, else (or when `full`) a full
    run."""
    inputs = space_inputs(storage, list(SOURCES), ENCODER)
    out, clusters = storage.table("semantic_duplicates"), storage.table("semantic_clusters")
    if full or incremental_semantic_duplicates(inputs, out, clusters, CONFIG) is None:
        streamed_semantic_duplicates(inputs, out, CONFIG, Tasks(use_ray=False), chunk_rows=200,
                                     bucket_rows=400, clusters_out=clusters)


@pytest.mark.e2e  # a run in a subprocess, killed
@pytest.mark.parametrize("point,mode", [("semdedup.duplicates_merged", "update"),
                                        ("semdedup.clusters_committed", "full")])
def test_a_kill_between_the_commits_leaves_a_rerun_consistent(tmp_path, point, mode):
    data = planted_duplicates(400, dim=16, topics=6, seed=3)
    storage = write_space(tmp_path / "data", data.vectors, data.pixels)
    run(storage)
    # stock gains near copies of rows of planted groups
    rng = np.random.default_rng(2)
    originals = rng.choice(np.flatnonzero(data.group >= 0), size=4, replace=False)
    new = data.vectors[originals] + rng.normal(size=(4, 16)).astype(np.float32) * 0.01
    new_ids = [f"stock:{1000 + i:06d}" for i in range(len(new))]
    write_embeddings(storage.table("image_embeddings", "stock"),
                     [pa.table({"id": new_ids, "embedding": new.tolist()})], ENCODER, [])
    hashes = pa.table({"id": new_ids, "pixels": pa.array(np.full(4, 10**6), pa.int64())})
    storage.table("phashes", "stock").open().insert(hashes)

    kill_held_at(_RUN, [str(tmp_path / "data"), mode], point, tmp_path / "marker.json")
    inputs = space_inputs(storage, list(SOURCES), ENCODER)
    clusters = storage.table("semantic_clusters")
    tag = fit_tag(inputs, CONFIG, True, DEFAULT_SAMPLE_ROWS)
    if mode == "full":  # the killed refit left no fit: the rerun runs in full
        assert read_fit(clusters, tag) is None
    run(storage)

    ids = space_ids(400).to_pylist() + new_ids
    listed = clusters.open().to_table(columns=["id"]).column("id").to_pylist()
    assert sorted(listed) == sorted(ids)  # every row once
    found = storage.table("semantic_duplicates").open().to_table().to_pylist()
    assert len({r["id"] for r in found}) == len(found)
    recorded = read_fit(clusters, tag)
    assert recorded is not None
    rank = np.r_[np.zeros(200), np.ones(200 + len(new))].astype(np.int32)
    expected = groups_at_fit(pa.array(ids), np.concatenate([data.vectors, new]),
                             np.r_[data.pixels, np.full(4, 10**6)], rank, recorded[0], CONFIG)
    assert {r["id"]: (r["kept_id"], r["group_size"], r["cluster"]) for r in found} == expected
