"""A BTREE index on a table's key column, kept up to date by the stage that writes it.

Without it, each chunk's merge-insert scans the whole key column to find the rows it
replaces: a first ingest of N rows in chunks of c costs O(N²/c). With it, Lance's
merge-insert takes its indexed path (a lookup per key) for the indexed fragments and scans
only the fragments added since the index was last brought up to date. So the writer keeps
those few: after a commit that left more than `max_unindexed_rows` rows unindexed, the new
fragments get a delta segment (cost: the new rows), and once there are `max_segments`
segments the newest are merged, size-tiered: an older segment joins the merge only while it
holds at most twice the rows taken so far, so a row is merged again only once its segment
has about doubled (O(log N) times, where merging the newest seven every few deltas rewrote
one segment growing with the table each time). Lance
compacts only fragments one segment covers together, so the writer compacts after each
index update: the fragments stay about as many as the segments, and each commit's
manifest small. Compaction remaps the index (Lance rewrites it with the fragments).

Lance's indexed merge path takes one key column: a target keyed on several columns
(captions: id and caption version) gets the index on its first, through which its writer
looks a chunk's rows up itself (`storage.keyed_writes`). An index is made once a table holds
`min_rows` rows: below that a scan of the ids costs less than the index's own version.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import lance

from prx_assets.storage.refs import TableRef

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KeyIndexPolicy:
    """When the writer makes and refreshes its key index (see the module's text)."""

    min_rows: int = 65_536
    max_unindexed_rows: int = 65_536
    max_segments: int = 8
    enabled: bool = True


def index_name(column: str) -> str:
    return f"{column}_idx"


def key_index_stats(dataset: lance.LanceDataset, column: str) -> dict | None:
    """Lance's statistics of the key index (segments, indexed and unindexed rows), None
    while there is none."""
    name = index_name(column)
    if not any(d.name == name for d in dataset.describe_indices()):
        return None
    return dataset.stats.index_stats(name)


def indexable_key(keys: list[str]) -> str | None:
    """The column a key index serves: the first key (`id`). Lance's merge-insert looks a
    single key up through it; a writer keyed on several columns looks its rows up by the
    first through it (`engine.chunked.upsert_looked_up`)."""
    return keys[0] if keys else None


def maintain_key_index(table: TableRef, column: str, policy: KeyIndexPolicy,
                       session: lance.Session | None = None) -> str:
    """Bring the key index of `table` up to `policy`: create it once the table is big
    enough, add a delta segment for the unindexed rows, merge the segments when there are
    too many. Returns what it did ("created", "delta", "merged" or "" for nothing). Cheap
    when there is nothing to do: the decision reads the manifest only."""
    if not policy.enabled:
        return ""
    dataset = table.latest().open(session)
    stats = key_index_stats(dataset, column)
    if stats is None:
        if dataset.count_rows() < policy.min_rows:
            return ""
        try:
            dataset.create_scalar_index(column, "BTREE", name=index_name(column),
                                        replace=False)
        except RuntimeError:
            # A concurrent writer made it first (never replace theirs): nothing to do.
            if key_index_stats(table.latest().open(), column) is None:
                raise
            return ""
        return "created"
    if stats["num_segments"] >= policy.max_segments:
        merge_newest_segments(dataset, column, stats)
        return "merged"
    if stats["num_unindexed_rows"] > policy.max_unindexed_rows:
        add_delta(dataset, column)
        return "delta"
    return ""


def add_delta(dataset: lance.LanceDataset, column: str) -> None:
    """A new segment for the unindexed rows (their cost only; no segment is merged)."""
    dataset.optimize.optimize_indices(index_names=[index_name(column)], num_indices_to_merge=0)


def segments_to_merge(rows_per_segment: list[int]) -> int:
    """How many of the newest segments (sizes oldest first) to merge: the newest two, and
    each older one while it holds at most twice the rows taken so far."""
    taken, count = sum(rows_per_segment[-2:]), 2
    while count < len(rows_per_segment) and rows_per_segment[-count - 1] <= 2 * taken:
        count += 1
        taken += rows_per_segment[-count]
    return count


def merge_newest_segments(dataset: lance.LanceDataset, column: str, stats: dict) -> None:
    """Merge the newest segments (and the unindexed rows) into one, size-tiered
    (`segments_to_merge`): the cost grows with the rows added since, not with the table."""
    count = segments_to_merge(list(stats["num_indexed_rows_per_delta"]))
    dataset.optimize.optimize_indices(index_names=[index_name(column)],
                                      num_indices_to_merge=count)


def refresh_key_index(table: TableRef, column: str, policy: KeyIndexPolicy,
                      session: lance.Session | None = None) -> str:
    """After a run, before its compaction: every row indexed (a delta segment for the
    rows still unindexed: their cost only), then the newest segments merged if that made
    too many (here, not in the next run's first commit: a small rerun pays only its own
    delta). Creates the index if the table is big enough."""
    if not policy.enabled:
        return ""
    dataset = table.latest().open(session)
    stats = key_index_stats(dataset, column)
    if stats is None:
        return maintain_key_index(table, column, policy, session)
    done = ""
    if stats["num_unindexed_rows"]:
        add_delta(dataset, column)
        dataset = table.latest().open(session)
        stats, done = key_index_stats(dataset, column), "delta"
    if stats is not None and stats["num_segments"] >= policy.max_segments:
        merge_newest_segments(dataset, column, stats)
        return "merged"
    return done
