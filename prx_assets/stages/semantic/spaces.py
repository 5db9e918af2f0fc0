"""The `concepts` table, streamed: the hierarchy fitted on a sample of the space, every
vector assigned to its leaf in a task per chunk (`streamed.route_chunk`), the leaves'
budgets water-filled on the driver from their sizes alone, and each bucket of leaves'
balanced sample drawn and written by a task of its own.

A leaf keeps, as its balanced sample, its rows of smallest key (a seeded hash of the id,
`keys.id_keys`), and shows its rows of smallest key first: the same draw whichever task,
node or bucket runs it and whatever order the embeddings are stored in (the in-memory
`concepts.balanced_selection` given the same keys draws the same sample).

A full run given a `tag` records its fit in the table's config (`FIT_KEY`): the leaves'
centroids and parents, each leaf's size and balanced count, and the fit sample's mean
cosine to its nearest leaf centroid; and, per source, the embeddings version consumed. An
update (`incremental_concepts`) assigns only the rows written since to the recorded leaves
and appends their rows, each balanced with its leaf's balanced share (the budgets are
water-filled again at the next refit). Its drift measure is the fall of the new rows'
mean cosine to their leaf centroid below the fit's: new rows the leaves describe as well
as the fit's own (a small fall) change no concept, new content (a large fall: rows far
from every leaf) needs new leaves. Above `max_drift`, or on deleted or rewritten rows, a
compaction, other settings, it returns None: the caller refits.
"""

from __future__ import annotations

import base64
import io
import json
import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from prx_assets.stages.semantic import streamed
from prx_assets.stages.semantic.concepts import budgets_of, hierarchical_kmeans, level_sizes
from prx_assets.stages.semantic.keys import id_keys, unit_draws
from prx_assets.stages.semantic.kmeans import ASSIGN_CHUNK_ROWS, normalise
from prx_assets.storage.changes import (
    consumed_at,
    forget_consumed,
    forget_large_record,
    pinned_changes,
    read_consumed,
    read_large_record,
    record_consumed,
    rows_with_ids,
    write_large_record,
)
from prx_assets.storage.filters import eq_filter
from prx_assets.storage.lance_tables import append_rows, commit_fragments, overwrite_rows
from prx_assets.storage.refs import TableRef
from prx_assets.storage.tables import IMAGE_EMBEDDINGS

FIT_KEY = "prx.concepts.fit"
DEFAULT_MAX_DRIFT = 0.02  # the new rows' mean cosine to their leaf may fall this far

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
    run: str = "full"
    drift: float | None = None  # an update's: the fit's mean cosine less the new rows'
    new_rows: int = 0


def streamed_concepts(inputs: streamed.SpaceInputs, out: TableRef, level_counts: Sequence[int],
                      target: int, seed: int, tasks: streamed.Tasks, first_ids: int = 3,
                      sample_rows: int = streamed.DEFAULT_SAMPLE_ROWS,
                      chunk_rows: int = streamed.DEFAULT_CHUNK_ROWS,
                      bucket_rows: int = streamed.DEFAULT_BUCKET_ROWS,
                      tag: str | None = None) -> StreamedConcepts:
    """The `concepts` table of every source's vectors (a row per sample per level) written
    to `out` as one version; `target` samples balanced over the hierarchy. With `tag`, the
    fit is recorded for `incremental_concepts`."""
    rows = inputs.rows
    forget_fit(out)  # a run killed before its record leaves none: the next one refits
    read_version = out.latest_version()
    if rows == 0:
        return StreamedConcepts(0, overwrite_rows(out, CONCEPTS_SCHEMA.empty_table(),
                                                  CONCEPTS_SCHEMA))
    fit = streamed.sample(inputs, tasks, sample_rows, seed, chunk_rows)
    tree = hierarchical_kmeans(fit, level_counts, seed)
    chunks = streamed.chunks(inputs, chunk_rows)
    buckets = streamed.routed_buckets(inputs, chunks, bucket_rows)
    leaves = tasks.put(tree.centroids[0])  # once: a copy per chunk grew with the chunks
    calls = [(c, inputs.encoder, leaves, buckets, False) for c in chunks]
    leaf_sizes, routed = tasks.scatter(streamed.route_chunk, calls, buckets)
    budgets = budgets_of(leaf_sizes, tree.parents, target)
    result = StreamedConcepts(rows, 0, level_sizes(leaf_sizes, tree.parents), budgets,
                              sample_rows=len(fit))
    fragments: list = []
    shared_budgets = tasks.put(budgets)
    reduce_calls = [(shared_budgets, tree.parents, seed, first_ids, out,
                     *[r[b] for r in routed]) for b in range(buckets)]
    for bucket in tasks.map(concepts_bucket, reduce_calls):
        fragments.extend(pickle.loads(f) for f in bucket["fragments"])
        result.first_ids.update(bucket["first_ids"])
        tasks.nodes.add(bucket["node"])
    result.version = commit_fragments(out, fragments, CONCEPTS_SCHEMA, read_version)
    result.nodes = set(tasks.nodes)
    if tag is not None:
        record_fit(out, inputs, tag, FitRecord(
            tree.centroids[0], tree.parents, np.asarray(leaf_sizes, np.int64),
            np.asarray(budgets, np.int64), fit_cosine(fit, tree.centroids[0]),
            result.first_ids))
    return result


def concepts_bucket(budgets: np.ndarray, parents: list[np.ndarray], seed: int,
                    first_ids: int, out: TableRef, *parts: streamed.Routed) -> dict:
    """One bucket of leaves (a task): each leaf's balanced sample, and a row per sample per
    level written as fragments of `out`."""
    routed = streamed.merge_routed(parts)
    keys = id_keys(routed.ids, seed)
    keep = np.zeros(len(routed.rows), bool)
    firsts: dict[int, list[str]] = {}
    for leaf, positions in streamed.clusters_of(routed):
        by_key = positions[np.argsort(keys[positions], kind="stable")]
        keep[by_key[:int(budgets[leaf])]] = True
        firsts[leaf] = routed.ids.take(pa.array(by_key[:first_ids])).to_pylist()
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


# -- the record of the fit, and the update from what changed ------------------------------

def concepts_tag(inputs: streamed.SpaceInputs, level_counts: Sequence[int], target_share: float,
                 seed: int, sample_rows: int) -> str:
    """What decides the concepts besides the rows: the record is kept under it."""
    return json.dumps({"encoder": inputs.encoder, "levels": [int(k) for k in level_counts],
                       "target_share": target_share, "seed": seed, "sample_rows": sample_rows,
                       "sources": [[p.rank, p.source] for p in inputs.parts]}, sort_keys=True)


@dataclass
class FitRecord:
    leaves: np.ndarray  # (leaves, d) unit centroids
    parents: list[np.ndarray]
    sizes: np.ndarray  # rows per leaf
    kept: np.ndarray  # balanced rows per leaf
    cosine: float  # the fit sample's mean cosine to its nearest leaf
    first_ids: dict[int, list[str]]


def fit_cosine(vectors: np.ndarray, centroids: np.ndarray,
               chunk_rows: int = ASSIGN_CHUNK_ROWS) -> float:
    """Mean cosine of unit rows to their nearest centroid (chunked)."""
    if len(vectors) == 0:
        return 1.0
    total = 0.0
    for start in range(0, len(vectors), chunk_rows):
        total += float((vectors[start:start + chunk_rows] @ centroids.T).max(axis=1).sum())
    return total / len(vectors)


def _array(values: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, values)
    return base64.b64encode(buffer.getvalue()).decode()


def _unarray(text: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(text)))


def embeddings_name(source: str) -> str:
    return f"{IMAGE_EMBEDDINGS}/{source}"


def record_fit(out: TableRef, inputs: streamed.SpaceInputs, tag: str, fit: FitRecord) -> None:
    """The fit in `out`'s config, then what it consumed of each source."""
    record = {"tag": tag, "leaves": _array(fit.leaves.astype(np.float32)),
              "parents": [_array(np.asarray(p, np.int64)) for p in fit.parents],
              "sizes": _array(fit.sizes), "kept": _array(fit.kept), "cosine": fit.cosine,
              "first_ids": {str(k): v for k, v in fit.first_ids.items()}}
    write_large_record(out, FIT_KEY, json.dumps(record))  # the same again commits nothing
    for part in inputs.parts:
        record_consumed(out, embeddings_name(part.source), consumed_at(part.table.open(), tag))


def read_fit(out: TableRef, tag: str) -> FitRecord | None:
    text = read_large_record(out, FIT_KEY)
    record = json.loads(text) if text else None
    if record is None or record.get("tag") != tag:
        return None
    return FitRecord(_unarray(record["leaves"]), [_unarray(p) for p in record["parents"]],
                     _unarray(record["sizes"]), _unarray(record["kept"]), record["cosine"],
                     {int(k): v for k, v in record["first_ids"].items()})


def forget_fit(out: TableRef) -> None:
    if not out.exists():
        return
    forget_consumed(out)
    forget_large_record(out, FIT_KEY)


def _added_rows(inputs: streamed.SpaceInputs, out: TableRef, tag: str) -> pa.Table | None:
    """(id, embedding) of the rows written since the records; None when rows were deleted
    or rewritten, or the changes are unknown."""
    parts = []
    for part in inputs.parts:
        since = read_consumed(out, embeddings_name(part.source), tag)
        if since is None:
            return None
        changes = pinned_changes(part.table, since, limit=part.table.open().count_rows())
        if changes is None or changes.removed is None or len(changes.removed):
            return None
        parts.append(part.table.to_table(columns=["id", "embedding"], filter=(
            f"({eq_filter('encoder', inputs.encoder)}) AND ({changes.added_filter})")))
    added = pa.concat_tables(parts) if parts else None
    if added is not None and added.num_rows and rows_with_ids(
            out.open(), added.column("id").combine_chunks(), ["id"]).num_rows:
        return None  # rewritten rows (or a killed update's): their old rows would stay
    return added


def incremental_concepts(inputs: streamed.SpaceInputs, out: TableRef, tag: str, seed: int,
                         max_drift: float = DEFAULT_MAX_DRIFT, max_changed_share: float = 0.1
                         ) -> StreamedConcepts | None:
    """`out` updated with the rows written since the record, assigned to the recorded
    leaves (see the module's text); None when a refit is needed."""
    fit = read_fit(out, tag)
    added = _added_rows(inputs, out, tag) if fit is not None else None
    if fit is None or added is None or added.num_rows > max_changed_share * max(1, inputs.rows):
        return None
    result = StreamedConcepts(inputs.rows, out.open().version, run="update", drift=0.0,
                              new_rows=added.num_rows)
    if added.num_rows:
        flat = added.column("embedding").combine_chunks()
        vectors = normalise(flat.flatten().to_numpy(zero_copy_only=False).reshape(
            len(flat), flat.type.list_size))
        scores = vectors @ fit.leaves.T
        leaf = scores.argmax(axis=1)
        result.drift = fit.cosine - float(scores.max(axis=1).mean())
        if result.drift > max_drift:
            return None
        share = fit.kept / np.maximum(1, fit.sizes)
        keep = unit_draws(id_keys(added.column("id"), seed)) < share[leaf]
        levels = [leaf.astype(np.int64)]
        for parent in fit.parents:
            levels.append(parent[levels[-1]])
        result.version = append_rows(out, concept_rows(added.column("id").combine_chunks(),
                                                       levels, keep), CONCEPTS_SCHEMA)
        fit.sizes = fit.sizes + np.bincount(leaf, minlength=len(fit.sizes))
        fit.kept = fit.kept + np.bincount(leaf[keep], minlength=len(fit.kept))
    record_fit(out, inputs, tag, fit)
    result.sizes = level_sizes(fit.sizes, fit.parents)
    result.budgets, result.first_ids = fit.kept, fit.first_ids
    return result
