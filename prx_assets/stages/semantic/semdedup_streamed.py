"""SemDeDup over every source's vectors without gathering them (`streamed`); its update from
what changed at a fixed fit is `semdedup_update`.

A full run fits the k-means on a sample, assigns every vector in Ray tasks and groups each
bucket of clusters in a task of its own (`semdedup.cluster_groups`, `semdedup.kept_copies`:
the in-memory path's functions). Its tasks also write every row's cluster, with its vector,
to `semantic_clusters`, whose config records the fit (the centroids) and, per source, the
`image_embeddings` version consumed whole (`storage.changes`), under a tag naming the
encoder, the settings and the sources in order.
"""

from __future__ import annotations

import base64
import io
import json
import pickle
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from prx_assets.stages.semantic import streamed
from prx_assets.stages.semantic.embeddings import vector_column
from prx_assets.stages.semantic.kmeans import kmeans
from prx_assets.stages.semantic.semdedup import (
    SEMANTIC_DUPLICATES_SCHEMA,
    SemDedupConfig,
    cluster_groups,
    kept_copies,
    largest_groups,
    reported_only,
    split_large,
)
from prx_assets.storage.changes import (
    consumed_at,
    forget_consumed,
    forget_large_record,
    read_large_record,
    record_consumed,
    write_large_record,
)
from prx_assets.storage.failpoints import failpoint
from prx_assets.storage.lance_tables import commit_fragments, overwrite_rows
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
