"""SemDeDup over every source's vectors without gathering them (`streamed`), and its update
from what changed at a fixed fit.

A full run fits the k-means on a sample, assigns every vector in Ray tasks and groups each
bucket of clusters in a task of its own (`semdedup.cluster_groups`, `semdedup.kept_copies`:
the in-memory path's functions). Its tasks also write every row's cluster, with its vector,
to `semantic_clusters`, whose config records the fit (the centroids) and, per source, the
`image_embeddings` version consumed whole (`storage.changes`), under a tag naming the
encoder, the settings and the sources in order.

An update (`incremental_semantic_duplicates`) assigns the rows written since to the
recorded centroids, finds the clusters those rows and the rows deleted or rewritten since
belong to, reads only those clusters' rows back from `semantic_clusters`, regroups them,
and replaces their rows of `semantic_duplicates` in one commit. At a fixed fit its groups
and kept copies are a full run's on the same rows, except where a cluster over
`cluster_cap` is split again (the split's k-means sees the rows in another order); the
group numbers of new groups are new rows' numbers, not the positions a full run gives.
The fit is never refitted by an update: a full run refits (the asset's `refit`, or no
record, other settings, a compaction, more than `max_changed_share` of the rows changed).
"""

from __future__ import annotations

import base64
import io
import json
import pickle
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prx_assets.stages.semantic import streamed
from prx_assets.stages.semantic.embeddings import vector_column
from prx_assets.stages.semantic.kmeans import assign, kmeans, normalise
from prx_assets.stages.semantic.semdedup import (
    SEMANTIC_DUPLICATES_SCHEMA,
    SemDedupConfig,
    cluster_groups,
    kept_copies,
    largest_groups,
    reported_only,
    roots,
    split_large,
    union,
)
from prx_assets.storage.changes import (
    SCAN_ROWS,
    consumed_at,
    forget_consumed,
    forget_large_record,
    pinned_changes,
    read_consumed,
    read_large_record,
    record_consumed,
    rows_with_ids,
    scan_rows_with_ids,
    write_large_record,
)
from prx_assets.storage.failpoints import failpoint
from prx_assets.storage.filters import eq_filter, in_filter
from prx_assets.storage.lance_tables import append_rows, commit_fragments, overwrite_rows
from prx_assets.storage.refs import TableRef
from prx_assets.storage.tables import IMAGE_EMBEDDINGS

MAX_FIT_ROWS = streamed.DEFAULT_SAMPLE_ROWS  # a fit grown with K stops there
FIT_KEY = "prx.semdedup.fit"  # semantic_clusters' config: the fit the rows were assigned by


def clusters_schema(dim: int) -> pa.Schema:
    """`semantic_clusters`: each vector's k-means cluster, with the vector (the rows an
    update regroups are read back by cluster, not gathered from every source)."""
    return pa.schema([
        pa.field("id", pa.string(), nullable=False),
        pa.field("row", pa.int64(), nullable=False),  # its number in the space
        pa.field("rank", pa.int32(), nullable=False),  # its source's rank
        pa.field("cluster", pa.int32(), nullable=False),
        pa.field("embedding", pa.list_(pa.float32(), dim)),
    ])


def fit_tag(inputs: streamed.SpaceInputs, config: SemDedupConfig, applied: bool,
            sample_rows: int) -> str:
    """What decides the groups besides the rows: the records are kept under it."""
    return json.dumps({"encoder": inputs.encoder, "config": repr(config), "applied": applied,
                       "sample_rows": sample_rows,
                       "sources": [[p.rank, p.source] for p in inputs.parts]}, sort_keys=True)


@dataclass
class StreamedSemDedup:
    """What a run wrote and the figures of the asset's metadata."""

    rows: int
    version: int
    clusters: int = 0
    largest_cluster: int = 0
    removed_by_eps: dict[float, int] = field(default_factory=dict)
    largest: list[dict] = field(default_factory=list)  # `largest_groups` over every bucket
    sample_rows: int = 0
    on_gpu: bool = False
    nodes: set[str] = field(default_factory=set)
    run: str = "full"
    changed_rows: int = 0  # an update: rows written or deleted since the record
    regrouped_rows: int = 0  # an update: rows of the touched clusters


def streamed_semantic_duplicates(inputs: streamed.SpaceInputs, out: TableRef,
                                 config: SemDedupConfig, tasks: streamed.Tasks,
                                 applied: bool = True,
                                 sample_rows: int = streamed.DEFAULT_SAMPLE_ROWS,
                                 chunk_rows: int = streamed.DEFAULT_CHUNK_ROWS,
                                 bucket_rows: int = streamed.DEFAULT_BUCKET_ROWS,
                                 clusters_out: TableRef | None = None) -> StreamedSemDedup:
    """The `semantic_duplicates` table of every source's vectors, written to `out` as one
    version, without the vectors ever in this process: k-means fitted on a sample of at
    most `sample_rows`, every vector assigned in a task per chunk, each bucket of clusters
    grouped and its kept copies chosen in a task of its own. On a space no larger than the
    sample, the table is `semdedup.semantic_duplicates`'s. With `clusters_out`, every row's
    cluster is written there too, with the fit and the records an update starts from."""
    rows = inputs.rows
    eps_values = config.all_eps()
    read_version = out.latest_version()
    if rows == 0:
        version = overwrite_rows(out, SEMANTIC_DUPLICATES_SCHEMA.empty_table(),
                                 SEMANTIC_DUPLICATES_SCHEMA)
        return StreamedSemDedup(0, version, removed_by_eps=dict.fromkeys(eps_values, 0))
    held = streamed.fit_resources(config.use_gpu) if tasks.use_ray else {}
    centroids, fitted, on_gpu = tasks.call(
        fit_centroids, (inputs, config, fit_rows(rows, config, sample_rows), chunk_rows,
                        tasks.use_ray, held.get("num_cpus", 0)), **held)
    chunks = streamed.chunks(inputs, chunk_rows)
    buckets = streamed.routed_buckets(inputs, chunks, bucket_rows, centroids.shape[1])
    shared = tasks.put(centroids)  # once: a copy per chunk grew with the chunks
    calls = [(c, inputs.encoder, shared, buckets, True) for c in chunks]
    _, routed = tasks.scatter(streamed.route_chunk, calls, buckets)
    phashes = inputs.phashes_by_rank()
    result = StreamedSemDedup(rows, 0, removed_by_eps=dict.fromkeys(eps_values, 0),
                              sample_rows=fitted, on_gpu=on_gpu)
    fragments: list = []
    cluster_fragments: list = []
    if clusters_out is not None:
        # A kill before both commits are done must not leave the old fit's record over new
        # rows: the next run then finds no record and runs in full.
        forget_fit(clusters_out)
    clusters_version = clusters_out.latest_version() if clusters_out else None
    reduce_calls = [(config, applied, phashes, out, clusters_out, *[r[b] for r in routed])
                    for b in range(buckets)]
    for bucket in tasks.map(semdedup_bucket, reduce_calls):
        fragments.extend(pickle.loads(f) for f in bucket["fragments"])
        cluster_fragments.extend(pickle.loads(f) for f in bucket["cluster_fragments"])
        add_stats(result, bucket)
        tasks.nodes.add(bucket["node"])
    if clusters_out is not None:
        commit_fragments(clusters_out, cluster_fragments, clusters_schema(centroids.shape[1]),
                         clusters_version)
        failpoint("semdedup.clusters_committed")
    result.version = commit_fragments(out, fragments, SEMANTIC_DUPLICATES_SCHEMA, read_version)
    if clusters_out is not None:  # after both commits: an update starts from these
        record_fit(clusters_out, inputs, fit_tag(inputs, config, applied, sample_rows),
                   centroids, rows)
    result.nodes = set(tasks.nodes)
    return result


def fit_rows(rows: int, config: SemDedupConfig, sample_rows: int) -> int:
    """The fit's sample: `sample_rows`, or `config.fit_rows_per_centroid` rows per centroid
    where that is more (up to `MAX_FIT_ROWS`). K grows with the rows: on a fixed sample of
    10^5, K = 2,000 at 10^7 saw 50 rows a centroid and left 9 % of the planted pairs in
    two clusters, never compared (256 a centroid: 5 %; docs/growth.md)."""
    grown = config.fit_rows_per_centroid * config.cluster_count(rows)
    return max(sample_rows, min(grown, MAX_FIT_ROWS))


def fit_centroids(inputs: streamed.SpaceInputs, config: SemDedupConfig, sample_rows: int,
                  chunk_rows: int, use_ray: bool, cpus: int = 0
                  ) -> tuple[np.ndarray, int, bool]:
    """(centroids, rows fitted on, on a GPU): the sample, drawn by tasks of its own, and
    the k-means; run as a task, so the sample (it grows with K) never sits in the driver."""
    if cpus:  # a Ray worker starts with one OpenMP thread whatever its task reserved
        import faiss

        faiss.omp_set_num_threads(cpus)
    fit = streamed.sample(inputs, streamed.Tasks(use_ray), sample_rows, config.seed,
                          chunk_rows)
    result = kmeans(fit, config.cluster_count(inputs.rows), config.seed,
                    use_gpu=config.use_gpu)
    return result.centroids, len(fit), result.on_gpu


def add_stats(result: StreamedSemDedup, bucket: dict) -> None:
    result.clusters += bucket["clusters"]
    result.largest_cluster = max(result.largest_cluster, bucket["largest_cluster"])
    for eps, n in bucket["removed"].items():
        result.removed_by_eps[eps] = result.removed_by_eps.get(eps, 0) + n
    result.largest = sorted([*result.largest, *bucket["largest"]],
                            key=lambda g: (-g["group_size"], g["kept_id"]))[:10]


def semdedup_bucket(config: SemDedupConfig, applied: bool, phashes: dict[int, TableRef],
                    out: TableRef, clusters_out: TableRef | None, *parts: streamed.Routed
                    ) -> dict:
    """One bucket of clusters (a task): its groups written as fragments of `out`, its rows'
    clusters as fragments of `clusters_out`."""
    routed = streamed.merge_routed(parts)
    table, stats = group_bucket(routed, config, applied, phashes)
    stats["fragments"] = streamed.write_rows(out, table, SEMANTIC_DUPLICATES_SCHEMA)
    stats["cluster_fragments"] = [] if clusters_out is None or routed.vectors is None else (
        streamed.write_rows(clusters_out, routed_rows(routed),
                            clusters_schema(routed.vectors.shape[1])))
    stats["node"] = streamed.node_id()
    return stats


def routed_rows(routed: streamed.Routed) -> pa.Table:
    assert routed.vectors is not None
    return pa.table({"id": routed.ids, "row": pa.array(routed.rows, pa.int64()),
                     "rank": pa.array(routed.rank, pa.int32()),
                     "cluster": pa.array(routed.cluster, pa.int32()),
                     "embedding": vector_column(routed.vectors)})


def group_bucket(routed: streamed.Routed, config: SemDedupConfig, applied: bool,
                 phashes: dict[int, TableRef]) -> tuple[pa.Table, dict]:
    """The groups of every cluster of `routed` (rows in row order) at every eps and their
    kept copies (pixels looked up for the members only): the duplicates rows and stats."""
    eps_values = config.all_eps()
    acting = eps_values.index(config.eps)
    n = len(routed.rows)
    group = np.arange(n, dtype=np.int64)
    cluster_of = np.zeros(n, np.int32)
    removed = dict.fromkeys(eps_values, 0)
    clusters = largest = 0
    vectors = routed.vectors if routed.vectors is not None else np.zeros((0, 1), np.float32)
    for cluster, positions in streamed.clusters_of(routed):
        for rows in split_large(vectors, [positions], config, depth=0):
            labels = cluster_groups(vectors[rows], eps_values, config.block_rows)
            for eps, level in zip(eps_values, labels, strict=True):
                removed[eps] += int(rows.size - np.unique(level).size)
            group[rows] = rows[labels[acting]]
            cluster_of[rows] = cluster
            clusters += 1
            largest = max(largest, int(rows.size))
    sizes = np.bincount(group, minlength=n)
    members = np.flatnonzero(sizes[group] > 1)
    pixels = np.zeros(n, np.int64)
    pixels[members] = streamed.pixels_of(routed.ids.take(pa.array(members)),
                                         routed.rank[members], phashes)
    table = kept_copies(routed.ids, group, pixels, routed.rank, cluster_of, vectors)
    # Group numbers in the space's rows (the positions are in row order).
    local = table.column("group").to_numpy()
    table = table.set_column(table.schema.get_field_index("group"),
                             SEMANTIC_DUPLICATES_SCHEMA.field("group"),
                             pa.array(routed.rows[local], pa.int64()))
    if not applied:
        table = reported_only(table)
    return table, {"clusters": clusters, "largest_cluster": largest, "removed": removed,
                   "largest": largest_groups(table)}


# -- the record of the fit, and the update from what changed ------------------------------

def embeddings_name(source: str) -> str:
    return f"{IMAGE_EMBEDDINGS}/{source}"


def record_fit(clusters: TableRef, inputs: streamed.SpaceInputs, tag: str,
               centroids: np.ndarray, next_row: int) -> None:
    """The centroids and the next row number in `clusters`' config, then what it consumed
    of each source (the update's starting point)."""
    buffer = io.BytesIO()
    np.save(buffer, centroids.astype(np.float32))
    record = {"tag": tag, "next_row": int(next_row),
              "centroids": base64.b64encode(buffer.getvalue()).decode()}
    write_large_record(clusters, FIT_KEY, json.dumps(record))
    for part in inputs.parts:
        record_consumed(clusters, embeddings_name(part.source),
                        consumed_at(part.table.open(), tag))


def forget_fit(clusters: TableRef) -> None:
    """Drop the recorded fit and records (before `clusters` is overwritten by another fit)."""
    if not clusters.exists():
        return
    forget_consumed(clusters)
    forget_large_record(clusters, FIT_KEY)


def read_fit(clusters: TableRef, tag: str) -> tuple[np.ndarray, int] | None:
    """(centroids, next row number) recorded under `tag`; None without one."""
    text = read_large_record(clusters, FIT_KEY)
    if text is None:
        return None
    record = json.loads(text)
    if record.get("tag") != tag:
        return None
    centroids = np.load(io.BytesIO(base64.b64decode(record["centroids"])))
    return centroids, int(record["next_row"])


@dataclass
class _Delta:
    """The rows written since the records (assigned) and the ids written or deleted."""

    added: list[pa.Table] = field(default_factory=list)  # id, rank, embedding
    gone: list[pa.Array] = field(default_factory=list)
    changed: int = 0


def _delta(inputs: streamed.SpaceInputs, clusters: TableRef, tag: str) -> _Delta | None:
    delta = _Delta()
    for part in inputs.parts:
        since = read_consumed(clusters, embeddings_name(part.source), tag)
        if since is None:
            return None
        changes = pinned_changes(part.table, since, limit=part.table.open().count_rows())
        if changes is None or changes.removed is None:
            return None
        rows = part.table.to_table(columns=["id", "embedding"], filter=(
            f"({eq_filter('encoder', inputs.encoder)}) AND ({changes.added_filter})"))
        deleted = changes.deleted if changes.deleted is not None else changes.removed
        delta.added.append(rows.append_column(
            "rank", pa.array(np.full(rows.num_rows, part.rank, np.int32))))
        delta.gone.extend([rows.column("id").combine_chunks(), deleted])
        delta.changed += rows.num_rows + len(deleted)
    return delta


def incremental_semantic_duplicates(
        inputs: streamed.SpaceInputs, out: TableRef, clusters: TableRef,
        config: SemDedupConfig, applied: bool = True,
        sample_rows: int = streamed.DEFAULT_SAMPLE_ROWS,
        max_changed_share: float = 0.1) -> StreamedSemDedup | None:
    """`out` and `clusters` updated from the changes since the records, at the recorded
    fit (see the module's text); None when a full run is needed."""
    tag = fit_tag(inputs, config, applied, sample_rows)
    recorded = read_fit(clusters, tag) if out.exists() else None
    if recorded is None or not inputs.parts:
        return None
    centroids, next_row = recorded
    delta = _delta(inputs, clusters, tag)
    if delta is None or delta.changed > max_changed_share * max(1, inputs.rows):
        return None
    result = StreamedSemDedup(inputs.rows, out.open().version, run="update",
                              changed_rows=delta.changed)
    added = pa.concat_tables(delta.added)
    flat = added.column("embedding").combine_chunks()
    vectors = normalise(flat.flatten().to_numpy(zero_copy_only=False).reshape(
        len(flat), centroids.shape[1])) if len(flat) else np.zeros((0, centroids.shape[1]),
                                                                   np.float32)
    new_cluster = assign(vectors, centroids).astype(np.int32)
    gone = pc.unique(pa.concat_arrays([a.cast(pa.string()) for a in delta.gone])) if (
        delta.gone) else pa.array([], pa.string())
    old = rows_with_ids(clusters.open(), gone, ["cluster"]) if len(gone) else None
    touched = np.unique(np.concatenate([new_cluster, old.column("cluster").to_numpy()
                                        if old is not None else np.zeros(0, np.int32)]))
    if touched.size == 0:
        record_fit(clusters, inputs, tag, centroids, next_row)
        result.removed_by_eps = {config.eps: _removed(out)}
        return result
    new_rows = pa.table({
        "id": added.column("id"), "row": pa.array(np.arange(next_row, next_row + len(vectors)),
                                                  pa.int64()),
        "rank": added.column("rank"), "cluster": pa.array(new_cluster, pa.int32()),
        "embedding": vector_column(vectors)}, schema=clusters_schema(centroids.shape[1]))
    left = set(old.column("cluster").to_pylist()) if old is not None else set()
    grown = sorted(set(touched.tolist()) - left)
    matches = _new_matches(clusters, new_rows, vectors, grown, config.eps)
    # A cluster grown past the cap is split again by a full regroup, as a full run would.
    oversized = {c for c in grown if matches.sizes.get(c, 0) > config.cluster_cap}
    regrouped = sorted(left | oversized)
    parts = []
    if regrouped:
        table, stats = _regroup(clusters, out, new_rows, regrouped, gone, config, applied,
                                inputs.phashes_by_rank())
        add_stats(result, stats)
        parts.append(table)
        result.regrouped_rows += stats["rows"]
    if len(grown) > len(oversized):
        table = _joined_groups(out, clusters, new_rows, matches, oversized, config, applied,
                               inputs.phashes_by_rank())
        add_stats(result, {"clusters": len(grown) - len(oversized),
                           "largest_cluster": max(matches.sizes.values(), default=0),
                           "removed": {}, "largest": largest_groups(table)})
        parts.append(table)
        result.regrouped_rows += table.num_rows
    # Rows of regrouped clusters are replaced; a grown cluster's groups only grow or merge,
    # so its changed groups' rows are all among those written (matched by id).
    merge = out.open().merge_insert("id").when_matched_update_all().when_not_matched_insert_all()
    if regrouped:
        merge = merge.when_not_matched_by_source_delete(
            f"cluster IN ({', '.join(str(int(c)) for c in regrouped)})")
    merge.execute(pa.concat_tables([t.cast(SEMANTIC_DUPLICATES_SCHEMA) for t in parts]))
    # A kill here: the records still hand the next run these changes, and rewriting the
    # same groups (by id) and inserting the same rows (by id) again leaves no copies.
    failpoint("semdedup.duplicates_merged")
    if old is None or old.num_rows == 0:  # only new ids: appended, no join with the table
        append_rows(clusters, new_rows, new_rows.schema)
    else:
        merge = (clusters.open().merge_insert("id").when_matched_update_all()
                 .when_not_matched_insert_all().when_not_matched_by_source_delete(
                     in_filter("id", gone.to_pylist())))
        merge.execute(new_rows)
    record_fit(clusters, inputs, tag, centroids, next_row + len(vectors))
    result.version = out.open().version
    result.removed_by_eps = {config.eps: _removed(out)}
    return result


def _regroup(clusters: TableRef, out: TableRef, new_rows: pa.Table, regrouped: list[int],
             gone: pa.Array, config: SemDedupConfig, applied: bool,
             phashes: dict[int, TableRef]) -> tuple[pa.Table, dict]:
    """The groups of `regrouped` clusters (rows left them, or they grew past the cap) from
    all their rows: those kept, read back from `clusters`, and the new ones."""
    listed = f"cluster IN ({', '.join(str(int(c)) for c in regrouped)})"
    kept_rows = clusters.open().to_table(filter=listed)
    kept_rows = kept_rows.filter(pc.invert(pc.is_in(kept_rows.column("id"), value_set=gone)))
    mine = new_rows.filter(pc.is_in(new_rows.column("cluster"),
                                    value_set=pa.array(regrouped, pa.int32())))
    both = pa.concat_tables([kept_rows.cast(new_rows.schema), mine])
    both = both.take(pc.sort_indices(both, [("row", "ascending")]))
    table, stats = group_bucket(_as_routed(both), config, applied, phashes)
    return table, {**stats, "rows": both.num_rows}


@dataclass
class _Matches:
    """What the new rows of grown clusters are close to: pairs (new row index, old row) and
    (new, new) above cosine 1 - eps, the old rows' ids, and each grown cluster's size."""

    new: np.ndarray  # int64 index into the new rows
    old_row: np.ndarray  # int64 row number of the old row matched
    old_ids: pa.Array
    new_pairs: tuple[np.ndarray, np.ndarray]
    sizes: dict[int, int]


def _new_matches(clusters: TableRef, new_rows: pa.Table, vectors: np.ndarray,
                 grown: list[int], eps: float, batch_rows: int = SCAN_ROWS) -> _Matches:
    """The new rows against the rows of their clusters, by one streamed scan of the grown
    clusters' vectors (old rows' pairs are unchanged at a fixed fit: only new x cluster is
    computed, and only the batch in hand is held)."""
    new_cluster = new_rows.column("cluster").to_numpy()
    by_cluster = {c: np.flatnonzero(new_cluster == c) for c in grown}
    sizes = {c: int(rows.size) for c, rows in by_cluster.items()}
    new_index, old_row, old_ids = [], [], []
    scanner = clusters.open().scanner(
        columns=["id", "row", "cluster", "embedding"], batch_size=batch_rows,
        filter=f"cluster IN ({', '.join(str(c) for c in grown)})" if grown else "FALSE")
    for batch in scanner.to_batches():
        cluster = batch.column("cluster").to_numpy()
        flat = batch.column("embedding")
        old = flat.flatten().to_numpy(zero_copy_only=False).reshape(len(flat), -1)
        rows = batch.column("row").to_numpy()
        routed = streamed.Routed(rows, batch.column("id"), np.zeros(0), cluster, None)
        for c, positions in streamed.clusters_of(routed):
            sizes[c] += positions.size
            fresh = by_cluster[c]
            i, j = np.nonzero(old[positions] @ vectors[fresh].T > 1.0 - eps)
            new_index.append(fresh[j])
            old_row.append(rows[positions[i]])
            old_ids.append(batch.column("id").take(pa.array(positions[i])))
    left, right = [], []
    for fresh in by_cluster.values():
        i, j = np.nonzero(np.triu(vectors[fresh] @ vectors[fresh].T > 1.0 - eps, k=1))
        left.append(fresh[i])
        right.append(fresh[j])
    empty = np.zeros(0, np.int64)
    return _Matches(np.concatenate([empty, *new_index]), np.concatenate([empty, *old_row]),
                    pa.concat_arrays([pa.array([], pa.string()), *old_ids]),
                    (np.concatenate([empty, *left]), np.concatenate([empty, *right])), sizes)


def _joined_groups(out: TableRef, clusters: TableRef, new_rows: pa.Table, matches: _Matches,
                   skipped: set[int], config: SemDedupConfig, applied: bool,
                   phashes: dict[int, TableRef]) -> pa.Table:
    """The groups a new row joined or formed in grown clusters (not `skipped`), with every
    member and their kept copies: the old groups of the rows matched, merged through the
    new rows (each group numbered by its smallest row, as a full run numbers it)."""
    keep = ~np.isin(new_rows.column("cluster").to_numpy(), list(skipped))
    pick = keep[matches.new]
    old_ids = matches.old_ids.filter(pa.array(pick))
    old_row, new_of_old = matches.old_row[pick], matches.new[pick]
    left, right = matches.new_pairs
    both_kept = keep[left]
    left, right = left[both_kept], right[both_kept]
    first_new = int(new_rows.column("row")[0].as_py()) if new_rows.num_rows else 0
    # Old groups of the matched rows, then all their members.
    found = scan_rows_with_ids(out.open(), pc.unique(old_ids), ["id", "group"]) if len(
        old_ids) else SEMANTIC_DUPLICATES_SCHEMA.empty_table().select(["id", "group"])
    group_of = dict(zip(found.column("id").to_pylist(), found.column("group").to_pylist(),
                        strict=True))
    old_group = np.array([group_of.get(i, r) for i, r in zip(
        old_ids.to_pylist(), old_row.tolist(), strict=True)], np.int64)
    # Union-find over row numbers: new rows, old rows matched, old groups (their smallest
    # row stands for the group).
    nodes = np.unique(np.concatenate([old_row, old_group, left + first_new,
                                      right + first_new, new_of_old + first_new]))
    parent = union(np.arange(nodes.size, dtype=np.int64),
                   np.searchsorted(nodes, np.concatenate([new_of_old + first_new, old_row,
                                                          left + first_new])),
                   np.searchsorted(nodes, np.concatenate([old_row, old_group,
                                                          right + first_new])))
    label = nodes[roots(parent)]  # each node's component: its smallest row
    joined = np.unique(label[nodes >= first_new])
    label_of = dict(zip(nodes.tolist(), label.tolist(), strict=True))
    # Members: old groups' members (by group), old rows matched alone, new rows.
    groups = np.unique(old_group[np.isin(old_group, nodes[np.isin(label, joined)])])
    members = out.open().to_table(columns=["id", "group"], filter=(
        f"`group` IN ({', '.join(str(int(g)) for g in groups)})")) if groups.size else None
    member_ids = pa.concat_arrays([
        members.column("id").combine_chunks() if members is not None else pa.array(
            [], pa.string()), old_ids]) if len(old_ids) else pa.array([], pa.string())
    old = rows_with_ids(clusters.open(), pc.unique(member_ids),
                        ["id", "row", "rank", "cluster", "embedding"]) if len(
        member_ids) else new_rows.schema.empty_table()
    fresh = new_rows.filter(pa.array(np.isin(np.arange(new_rows.num_rows) + first_new,
                                             nodes)))
    rows = pa.concat_tables([old.cast(new_rows.schema), fresh])
    rows = rows.take(pc.sort_indices(rows, [("row", "ascending")]))
    if members is not None:
        group_of.update(zip(members.column("id").to_pylist(),
                            members.column("group").to_pylist(), strict=True))
    row_numbers = rows.column("row").to_numpy()
    # A row's node: itself when it is one, else (an unmatched old member) its old group.
    node = np.array([r if r in label_of else group_of[i] for r, i in zip(
        row_numbers.tolist(), rows.column("id").to_pylist(), strict=True)], np.int64)
    component = np.array([label_of[n] for n in node.tolist()], np.int64)
    chosen = np.isin(component, joined)
    rows, component, row_numbers = rows.filter(pa.array(chosen)), component[chosen], \
        row_numbers[chosen]
    routed = _as_routed(rows)
    local = np.searchsorted(row_numbers, component)  # the component's smallest row's position
    pixels = streamed.pixels_of(routed.ids, routed.rank, phashes)
    assert routed.vectors is not None
    table = kept_copies(routed.ids, local, pixels, routed.rank, routed.cluster, routed.vectors)
    table = table.set_column(table.schema.get_field_index("group"),
                             SEMANTIC_DUPLICATES_SCHEMA.field("group"),
                             pa.array(row_numbers[table.column("group").to_numpy()], pa.int64()))
    return reported_only(table) if not applied else table


def _as_routed(rows: pa.Table) -> streamed.Routed:
    flat = rows.column("embedding").combine_chunks()
    return streamed.Routed(
        rows.column("row").to_numpy(), rows.column("id").combine_chunks(),
        rows.column("rank").to_numpy(), rows.column("cluster").to_numpy(),
        flat.flatten().to_numpy(zero_copy_only=False).reshape(len(flat), flat.type.list_size))


def _removed(out: TableRef) -> int:
    """Rows of `out` that are not their group's kept copy (a streamed count)."""
    removed = 0
    for batch in out.open().to_batches(columns=["id", "kept_id"]):
        removed += pc.sum(pc.not_equal(batch.column("id"), batch.column("kept_id"))).as_py() or 0
    return removed
