"""SemDeDup's update from what changed, at the fit a full run recorded
(`semdedup_streamed`).

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

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prx_assets.stages.semantic import streamed
from prx_assets.stages.semantic.embeddings import vector_column
from prx_assets.stages.semantic.kmeans import assign, normalise
from prx_assets.stages.semantic.semdedup import (
    SEMANTIC_DUPLICATES_SCHEMA,
    SemDedupConfig,
    kept_copies,
    largest_groups,
    reported_only,
    roots,
    union,
)
from prx_assets.stages.semantic.semdedup_streamed import (
    StreamedSemDedup,
    add_stats,
    clusters_schema,
    embeddings_name,
    fit_tag,
    group_bucket,
    read_fit,
    record_fit,
)
from prx_assets.storage.changes import (
    SCAN_ROWS,
    pinned_changes,
    read_consumed,
    rows_with_ids,
    scan_rows_with_ids,
)
from prx_assets.storage.failpoints import failpoint
from prx_assets.storage.filters import eq_filter, in_filter
from prx_assets.storage.lance_tables import append_rows
from prx_assets.storage.refs import TableRef


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
