"""The `concepts` table, streamed: the hierarchy fitted on a sample of the space, every
vector assigned to its leaf in a task per chunk (`streamed.route_chunk`), the leaves'
budgets water-filled on the driver from their sizes alone, and each bucket of leaves'
balanced sample drawn and written by a task of its own.

A bucket's leaves draw their samples, leaf by leaf, from one generator seeded by (seed,
bucket): the same draw whichever task or node runs it. A space of one bucket draws from
`seed` alone, as `concepts.balanced_selection` does (the same sample as the in-memory path).
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from prx_assets.stages.semantic import streamed
from prx_assets.stages.semantic.concepts import budgets_of, hierarchical_kmeans, level_sizes
from prx_assets.storage.lance_tables import commit_fragments, overwrite_rows
from prx_assets.storage.refs import TableRef

CONCEPTS_SCHEMA = pa.schema([
    pa.field("id", pa.string(), nullable=False),
    pa.field("level", pa.int8(), nullable=False),  # 1 = leaves (finest)
    pa.field("cluster", pa.int32(), nullable=False),
    pa.field("balanced", pa.bool_(), nullable=False),  # kept by the balanced sample
])


@dataclass
class StreamedConcepts:
    """What `streamed_concepts` wrote and the figures of the asset's metadata."""

    rows: int
    version: int
    sizes: list[np.ndarray] = field(default_factory=list)  # samples per cluster, per level
    budgets: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # per leaf
    first_ids: dict[int, list[str]] = field(default_factory=dict)  # a leaf's first samples
    sample_rows: int = 0
    nodes: set[str] = field(default_factory=set)


def streamed_concepts(inputs: streamed.SpaceInputs, out: TableRef, level_counts: Sequence[int],
                      target: int, seed: int, tasks: streamed.Tasks, first_ids: int = 3,
                      sample_rows: int = streamed.DEFAULT_SAMPLE_ROWS,
                      chunk_rows: int = streamed.DEFAULT_CHUNK_ROWS,
                      bucket_rows: int = streamed.DEFAULT_BUCKET_ROWS) -> StreamedConcepts:
    """The `concepts` table of every source's vectors (a row per sample per level) written
    to `out` as one version; `target` samples balanced over the hierarchy."""
    rows = inputs.rows
    read_version = out.latest_version()
    if rows == 0:
        return StreamedConcepts(0, overwrite_rows(out, CONCEPTS_SCHEMA.empty_table(),
                                                  CONCEPTS_SCHEMA))
    fit = streamed.sample(inputs, tasks, sample_rows, seed, chunk_rows)
    tree = hierarchical_kmeans(fit, level_counts, seed)
    buckets = streamed.bucket_count(rows, bucket_rows)
    calls = [(c, inputs.encoder, tasks.put(tree.centroids[0]), buckets, False)
             for c in streamed.chunks(inputs, chunk_rows)]
    leaf_sizes, routed = tasks.scatter(streamed.route_chunk, calls, buckets)
    budgets = budgets_of(leaf_sizes, tree.parents, target)
    result = StreamedConcepts(rows, 0, level_sizes(leaf_sizes, tree.parents), budgets,
                              sample_rows=len(fit))
    fragments: list = []
    seeds = [seed] if buckets == 1 else [[seed, b] for b in range(buckets)]
    reduce_calls = [(tasks.put(budgets), tree.parents, seeds[b], first_ids, out,
                     *[r[b] for r in routed]) for b in range(buckets)]
    for bucket in tasks.map(concepts_bucket, reduce_calls):
        fragments.extend(pickle.loads(f) for f in bucket["fragments"])
        result.first_ids.update(bucket["first_ids"])
        tasks.nodes.add(bucket["node"])
    result.version = commit_fragments(out, fragments, CONCEPTS_SCHEMA, read_version)
    result.nodes = set(tasks.nodes)
    return result


def concepts_bucket(budgets: np.ndarray, parents: list[np.ndarray], seed: int | list[int],
                    first_ids: int, out: TableRef, *parts: streamed.Routed) -> dict:
    """One bucket of leaves (a task): each leaf's balanced sample, and a row per sample per
    level written as fragments of `out`."""
    routed = streamed.merge_routed(parts)
    keep = np.zeros(len(routed.rows), bool)
    firsts: dict[int, list[str]] = {}
    rng = np.random.default_rng(seed)
    for leaf, positions in streamed.clusters_of(routed):
        budget = int(budgets[leaf])
        if budget:
            keep[rng.choice(positions, size=min(budget, positions.size), replace=False)] = True
        firsts[leaf] = routed.ids.take(pa.array(positions[:first_ids])).to_pylist()
    levels = [routed.cluster.astype(np.int64)]
    for parent in parents:
        levels.append(parent[levels[-1]])
    table = concept_rows(routed.ids, levels, keep)
    return {"fragments": streamed.write_rows(out, table, CONCEPTS_SCHEMA), "first_ids": firsts,
            "node": streamed.node_id()}


def concept_rows(ids: pa.Array, levels: Sequence[np.ndarray], keep: np.ndarray) -> pa.Table:
    """One row per sample per level (`levels[l]`: each sample's cluster at level l+1)."""
    n = len(ids)
    return pa.table({
        "id": pa.concat_arrays([ids] * len(levels)) if n else pa.array([], pa.string()),
        "level": pa.array(np.repeat(np.arange(1, len(levels) + 1), n).astype(np.int8)),
        "cluster": pa.array(np.concatenate(levels).astype(np.int32)),
        "balanced": pa.array(np.tile(keep, len(levels))),
    }, schema=CONCEPTS_SCHEMA)
