"""What changed in an upstream Lance table since a downstream stage last consumed all of it,
found from the table's fragments instead of by comparing two whole id columns (issue 31:
a +1-file run on a 10⁸-row source must not read 10⁸ ids).

Lance never reuses a fragment id and never rewrites a fragment's rows in place: rows that
are appended, merge-inserted or moved by compaction land in fragments with new ids, and a
deleted row is only marked in its fragment's deletion vector. So a stage that recorded,
once it had consumed every row of version V, the next fragment id and each fragment's
deletion count (`Consumed`) can later ask (`changes_since`):

- which rows may be new or changed: those of fragments from `next_fragment` on, one
  `_rowaddr` filter (a row address is the fragment id << 32 | offset);
- which ids left: ids deleted from fragments it consumed, read from the fragments whose
  deletion count grew (Lance still reads a deleted row's values), less those the table
  still holds. A consumed fragment that is gone (compaction rewrote it) leaves the
  removals unknown (`removed` is None): the caller compares in full, once.

The record lives in the downstream table's Lance config (`prx.consumed.<upstream>`),
written only after a run finished every change it was handed. A kill before that leaves
the previous record: the next run is handed those changes again and its pending check
finds them done. Anything that empties the downstream table must `forget_consumed` first.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import lance
import pyarrow as pa
import pyarrow.compute as pc

from prx_assets.storage.filters import in_filter
from prx_assets.storage.refs import Location, TableRef

if TYPE_CHECKING:  # the loader plans through this module and must not import Ray
    import ray.data

CONFIG_PREFIX = "prx.consumed."
LOOKUP_IDS = 10_000  # ids per `IN` lookup (keeps the SQL bounded)
SCAN_ROWS = 1 << 18  # rows per batch of a streamed scan
RECORD_TRIES = 5  # a concurrent run's record conflicts with ours: re-read and retry


@dataclass(frozen=True)
class Consumed:
    """An upstream version a downstream stage consumed whole: its fragments then (as id
    ranges) and the rows deleted in each (only those with any), the next fragment id, and
    `tag`, what else decided the downstream rows (its settings: another tag, other rows)."""

    version: int
    next_fragment: int
    fragments: tuple[tuple[int, int], ...]  # [first, last] id ranges
    deletions: dict[int, int] = field(default_factory=dict)
    tag: str = ""

    def fragment_ids(self) -> set[int]:
        """The ids of the fragments it consumed (the ranges hold nothing else)."""
        return {i for first, last in self.fragments for i in range(first, last + 1)}

    def to_json(self) -> str:
        return json.dumps({"version": self.version, "next_fragment": self.next_fragment,
                           "fragments": self.fragments, "tag": self.tag,
                           "deletions": {str(k): v for k, v in self.deletions.items()}})

    @classmethod
    def from_json(cls, text: str) -> Consumed:
        data = json.loads(text)
        return cls(int(data["version"]), int(data["next_fragment"]),
                   tuple((int(a), int(b)) for a, b in data["fragments"]),
                   {int(k): int(v) for k, v in data["deletions"].items()}, str(data["tag"]))


def consumed_at(table: lance.LanceDataset, tag: str = "") -> Consumed:
    """What consuming every row of `table` (at its version) covers."""
    ids, deletions = [], {}
    for fragment in table.get_fragments():
        ids.append(fragment.fragment_id)
        if fragment.metadata.deletion_file is not None:
            deletions[fragment.fragment_id] = fragment.num_deletions
    return Consumed(table.version, next_fragment_id(table), id_ranges(sorted(ids)),
                    deletions, tag)


def next_fragment_id(table: lance.LanceDataset) -> int:
    """One above every fragment id the version holds. Lance gives new fragments ids above
    every id it ever gave, so fragments from this id on were all written after it (an id
    freed by compaction only makes the filter start lower than it could)."""
    return max((f.fragment_id for f in table.get_fragments()), default=-1) + 1


def id_ranges(ids: list[int]) -> tuple[tuple[int, int], ...]:
    ranges: list[tuple[int, int]] = []
    for i in ids:
        if ranges and ranges[-1][1] == i - 1:
            ranges[-1] = (ranges[-1][0], i)
        else:
            ranges.append((i, i))
    return tuple(ranges)


@dataclass(frozen=True)
class Changes:
    """Rows of the table that may be new or changed since `since` (`added_filter` selects
    them; `added_rows` counts them), the ids that left (None: unknown, compare in full),
    and every id with a row deleted since (`deleted`, a superset of `removed`: an id whose
    row of one caption version was deleted while another version's row stays)."""

    since: Consumed
    added_filter: str
    added_rows: int
    removed: pa.Array | None
    deleted: pa.Array | None = None


def changes_since(table: lance.LanceDataset, since: Consumed) -> Changes:
    """What changed from `since` to `table`'s version (a pinned version at or after it)."""
    fragments = table.get_fragments()
    consumed = since.fragment_ids()
    held = [f for f in fragments if f.fragment_id in consumed]
    added = Changes(since, added_filter(since), added_rows(fragments, since), None)
    if len(held) < len(consumed):
        return added  # a fragment it consumed is gone (rewritten or deleted whole)
    touched = [f for f in held if f.num_deletions > since.deletions.get(f.fragment_id, 0)]
    candidates = deleted_ids(table, touched)
    held_still = present_ids(table, candidates)
    return replace(added, deleted=candidates, removed=candidates.filter(
        pc.invert(pc.is_in(candidates, value_set=held_still))))


def added_filter(since: Consumed) -> str:
    """The rows in fragments written after `since`: new, changed or moved."""
    return f"_rowaddr >= {since.next_fragment << 32}"


def added_rows(fragments: list, since: Consumed) -> int:
    """How many rows of `fragments` (a version's) `added_filter` selects: their counts, no
    scan."""
    return sum(f.count_rows() for f in fragments if f.fragment_id >= since.next_fragment)


def deleted_ids(table: lance.LanceDataset, fragments: list) -> pa.Array:
    """The ids of every deleted row of `fragments` (their deletion vectors keep no values:
    the rows are read with `include_deleted_rows` and kept where Lance gives no row id).
    Cost: the fragments' rows, once; only fragments whose deletions grew are read."""
    if not fragments:
        return pa.array([], pa.string())
    rows = table.scanner(columns=["id"], with_row_id=True, include_deleted_rows=True,
                         fragments=fragments).to_table()
    return rows.filter(pc.is_null(rows.column("_rowid"))).column("id").combine_chunks()


def present_ids(table: lance.LanceDataset, ids: pa.Array) -> pa.Array:
    """Those of `ids` the table holds."""
    return rows_with_ids(table, ids, ["id"]).column("id").combine_chunks()


def rows_with_ids(table: lance.LanceDataset, ids: pa.Array, columns: list[str],
                  where: str | None = None, with_row_id: bool = False) -> pa.Table:
    """`columns` of the rows whose id is in `ids` (and that match `where`), looked up
    `LOOKUP_IDS` at a time: through the key index where the table has one, ~5 µs an id."""
    values = ids.to_pylist()
    chunks = [values[start:start + LOOKUP_IDS] for start in range(0, len(values), LOOKUP_IDS)]
    parts = []
    for chunk in chunks or [[]]:
        lookup = in_filter("id", chunk)
        parts.append(table.to_table(columns=columns, with_row_id=with_row_id,
                                    filter=f"({lookup}) AND ({where})" if where else lookup))
    return pa.concat_tables(parts)


def scan_rows_with_ids(table: lance.LanceDataset, ids: pa.Array, columns: list[str],
                       where: str | None = None, with_row_id: bool = False,
                       batch_rows: int = SCAN_ROWS) -> pa.Table:
    """`columns` of the rows whose id is in `ids` (and that match `where`), by one streamed
    scan: for ids too many to look up (a group of a full build), holding the ids and one
    batch, not the key index's pages (lookups of 10⁵ ids took ~150 MiB of them)."""
    scanner = table.scanner(columns=columns, filter=where, with_row_id=with_row_id,
                            batch_size=batch_rows)
    parts = [batch.filter(pc.is_in(batch.column("id"), value_set=ids))
             for batch in scanner.to_batches()]
    return pa.Table.from_batches(parts, schema=scanner.projected_schema)


def read_ids(table: TableRef, ids: pa.Array, columns: list[str], where: str | None = None
             ) -> ray.data.Dataset | None:
    """The rows of these ids (and matching `where`) as a Ray dataset, filtered by Lance in
    one `IN` (callers pass a bounded number of ids: a delta); None when there are none (no
    stage is built, no model loaded)."""
    if len(ids) == 0:
        return None
    lookup = in_filter("id", ids.to_pylist())
    return table.read(columns=columns, filter=f"({lookup}) AND ({where})" if where else lookup)


# --- the record, in the downstream table's config -----------------------------------------

def config_key(upstream: str) -> str:
    return CONFIG_PREFIX + upstream


def read_consumed(target: TableRef, upstream: str, tag: str = "") -> Consumed | None:
    """The record of what `target`'s stage consumed of `upstream` under `tag`; None when
    there is none, it is unreadable or it was made under another tag (consume in full)."""
    if not target.exists():
        return None
    text = target.latest().open().config().get(config_key(upstream))
    if text is None:
        return None
    try:
        consumed = Consumed.from_json(text)
    except (ValueError, KeyError, TypeError):
        return None
    return consumed if consumed.tag == tag else None


def record_consumed(target: TableRef, upstream: str, consumed: Consumed) -> None:
    """Record that every row of `consumed` has its downstream row in `target`. Config
    updates of two runs conflict in Lance: the loser re-reads the latest and retries (a
    record a concurrent run left is as true as ours). The same record again commits
    nothing: a run with nothing to do leaves the table's version where it was."""
    update_config(target, {config_key(upstream): consumed.to_json()})


def update_config(target: TableRef, entries: dict[str, str]) -> None:
    """Set `entries` in `target`'s Lance config in one commit, none if they are set already.
    Config updates of two runs conflict in Lance: the loser re-reads the latest and retries."""
    for attempt in range(RECORD_TRIES):
        table = target.latest().open()
        config = table.config()
        if all(config.get(key) == text for key, text in entries.items()):
            return
        update: dict[str, str | None] = dict(entries)
        try:
            table.update_config(update)
            return
        except OSError as exc:
            if "Incompatible transaction" not in str(exc) or attempt == RECORD_TRIES - 1:
                raise


def forget_consumed(target: TableRef) -> None:
    """Drop every record of `target` (before anything empties it: the records would hand
    the next run only changes, and the rows already consumed would never come back)."""
    if not target.exists():
        return
    table = target.latest().open()
    keys = [key for key in table.config() if key.startswith(CONFIG_PREFIX)]
    if keys:
        table.delete_config_keys(keys)


# --- per source, when its rows of a global table last changed --------------------------

GROUPS_PREFIX = "prx.groups_changed."


def record_groups_changed(target: TableRef, sources: Iterable[str], version: int) -> None:
    """Record that the rows of `sources` in `target` (a global table of groups across
    sources) changed at `version`: the per-source signal that starts those sources' skip
    lists, and only theirs (`defs/factory`). Kept in the table's config, beside the records
    of what it consumed, so a run killed after its commit still hands it on."""
    entries = {f"{GROUPS_PREFIX}{source}": str(int(version)) for source in sources}
    if entries:
        update_config(target, entries)


def groups_changed_at(target: TableRef) -> dict[str, int]:
    """Per source, the version of `target` at which its rows last changed (none recorded:
    absent)."""
    if not target.exists():
        return {}
    config = target.latest().open().config()
    return {key[len(GROUPS_PREFIX):]: int(text) for key, text in config.items()
            if key.startswith(GROUPS_PREFIX)}


# --- a large record, beside the table --------------------------------------------------

RECORDS_FOLDER = "_prx_records"  # inside the table's folder; Lance leaves unknown folders be


def write_large_record(target: TableRef, key: str, text: str) -> None:
    """`text` under `key`, in a file beside `target` with only the file's name in its config.
    Lance reads a table's whole config with every manifest: a fit's arrays there (10⁵
    centroids at 10⁹ rows, hundreds of MB) would be read by every open of the table. The
    file is named by its content's hash, never rewritten in place, so the config commit is
    still the one switch; files of `key` the config no longer names are removed after."""
    name = f"{key}-{hashlib.sha256(text.encode()).hexdigest()}.json"
    folder = _records_folder(target)
    if not (folder / name).exists():
        (folder / name).write_text(text)
    table = target.latest().open()
    if table.config().get(key) != name:  # the same record again commits nothing
        table.update_config({key: name})
    _remove_records(folder, key, keep=name)


def read_large_record(target: TableRef, key: str) -> str | None:
    """The text `write_large_record` kept under `key`; None without one, or when its file
    is gone (a newer record replaced it meanwhile): the caller then starts afresh."""
    if not target.exists():
        return None
    name = target.latest().open().config().get(key)
    if name is None:
        return None
    try:
        return (_records_folder(target) / name).read_text()
    except FileNotFoundError:
        return None


def forget_large_record(target: TableRef, key: str) -> None:
    if not target.exists():
        return
    table = target.latest().open()
    if key in table.config():
        table.delete_config_keys([key])
    _remove_records(_records_folder(target), key, keep=None)


def _records_folder(target: TableRef) -> Location:
    return Location(target.uri, target.settings) / RECORDS_FOLDER


def _remove_records(folder: Location, key: str, keep: str | None) -> None:
    for file in folder.files(".json"):
        if file.name.startswith(f"{key}-") and file.name != keep:
            file.delete()


# --- a stage handed its upstream's changes ------------------------------------------------

def handed_changes(upstream: TableRef, target: TableRef, name: str, tag: str,
                   where: str | None, limit: int) -> tuple[pa.Array, pa.Array] | None:
    """From `target`'s record of `upstream` (pinned) under `tag`: the ids of upstream rows
    matching `where` written since (new, or written again), and the ids that left it. None
    without a record, after a compaction of upstream (which ids left is unknown) or past
    `limit` rows written since: the caller compares in full."""
    since = read_consumed(target, name, tag)
    return None if since is None else ids_changed_since(upstream, since, where, limit)


def ids_changed_since(upstream: TableRef, since: Consumed, where: str | None, limit: int
                      ) -> tuple[pa.Array, pa.Array] | None:
    """The ids of `upstream` (pinned) rows matching `where` written since `since`, and the
    ids that left it; None when that cannot be told cheaply (see `pinned_changes`)."""
    changes = pinned_changes(upstream, since, limit)
    if changes is None or changes.removed is None:
        return None
    return added_ids(upstream, changes, where), changes.removed


def pinned_changes(upstream: TableRef, since: Consumed, limit: int) -> Changes | None:
    """The changes of `upstream` (pinned) since `since`; None when they cannot be told
    cheaply: after a compaction (which ids left is unknown), past `limit` rows written
    since, or when `upstream` is pinned at a version older than the record."""
    if upstream.version is not None and upstream.version < since.version:
        return None
    changes = changes_since(upstream.open(), since)
    return None if changes.removed is None or changes.added_rows > limit else changes


def added_ids(upstream: TableRef, changes: Changes, where: str | None) -> pa.Array:
    """The ids of the rows `changes` selects as written since (and matching `where`)."""
    condition = f"({where}) AND ({changes.added_filter})" if where else changes.added_filter
    return upstream.to_table(columns=["id"], filter=condition).column("id").combine_chunks()


def up_to_date_ids(done: pa.Table, upstream: pa.Table) -> pa.Array:
    """Ids whose downstream row (`id`, `created_at`) is no older than their upstream row
    (`id`, `created_at`): an upstream row written again since (a changed source item's new
    caption) makes its downstream row stale."""
    joined = done.join(upstream.select(["id", "created_at"]).rename_columns(
        ["id", "upstream_at"]), "id")
    fresh = pc.greater_equal(joined.column("created_at"), joined.column("upstream_at"))
    return joined.filter(fresh).column("id").combine_chunks()


def not_up_to_date(ids: pa.Array, target: TableRef, target_where: str, upstream: TableRef,
                   upstream_where: str) -> pa.Array:
    """Those of `ids` without a row in `target` (matching `target_where`) as new as their
    row in `upstream` (matching `upstream_where`): looked up by id in both."""
    if len(ids) == 0 or not target.exists():
        return ids
    done = rows_with_ids(target.latest().open(), ids, ["id", "created_at"], target_where)
    current = rows_with_ids(upstream.open(), ids, ["id", "created_at"], upstream_where)
    return ids.filter(pc.invert(pc.is_in(ids, up_to_date_ids(done, current))))
