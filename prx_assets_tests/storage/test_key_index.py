"""The key index's upkeep, appends of new rows, and the repair when a concurrent writer
brought the same keys (no Ray: plain Lance commits)."""

from __future__ import annotations

import pyarrow as pa
import pytest

from prx_assets.storage import lance_tables
from prx_assets.storage.key_index import (
    KeyIndexPolicy,
    key_index_stats,
    maintain_key_index,
    refresh_key_index,
    segments_to_merge,
)
from prx_assets.storage.keyed_writes import drop_later_copies
from prx_assets.storage.lance_tables import append_new, upsert
from prx_assets.storage.refs import TableRef

SCHEMA = pa.schema([("id", pa.string()), ("v", pa.int64())])
POLICY = KeyIndexPolicy(min_rows=10, max_unindexed_rows=5, max_segments=3)


def rows(start: int, stop: int, value: int = 0) -> pa.Table:
    return pa.table({"id": [f"k{i:03d}" for i in range(start, stop)],
                     "v": [value] * (stop - start)}, schema=SCHEMA)


def stats(table: TableRef) -> tuple[int, int] | None:
    found = key_index_stats(table.open(), "id")
    return None if found is None else (found["num_segments"], found["num_unindexed_rows"])


def unique_ids(table: TableRef) -> dict[str, int]:
    got = table.to_table()
    assert got.num_rows == len(set(got.column("id").to_pylist())), "duplicate ids"
    return dict(zip(got.column("id").to_pylist(), got.column("v").to_pylist(), strict=True))


def test_the_index_is_made_once_the_table_is_big_then_given_deltas_then_merged(tmp_path):
    table = TableRef.of(tmp_path / "t.lance")
    version, clean = append_new(table, rows(0, 8), SCHEMA, ["id"], None)
    assert (version, clean) == (1, True)
    assert maintain_key_index(table, "id", POLICY) == "" and stats(table) is None  # 8 < 10
    append_new(table, rows(8, 40), SCHEMA, ["id"], 1)
    assert maintain_key_index(table, "id", POLICY) == "created" and stats(table) == (1, 0)
    append_new(table, rows(40, 43), SCHEMA, ["id"], table.latest_version())
    assert maintain_key_index(table, "id", POLICY) == ""  # 3 unindexed rows: within the lag
    append_new(table, rows(43, 46), SCHEMA, ["id"], table.latest_version())
    assert maintain_key_index(table, "id", POLICY) == "delta" and stats(table) == (2, 0)
    append_new(table, rows(46, 52), SCHEMA, ["id"], table.latest_version())
    assert maintain_key_index(table, "id", POLICY) == "delta" and stats(table) == (3, 0)
    # Segments of 40, 6 and 6 rows: the newest two merged; the oldest, more than twice
    # their rows, left alone.
    assert maintain_key_index(table, "id", POLICY) == "merged" and stats(table) == (2, 0)
    upsert(table, rows(20, 30, 1), SCHEMA, ["id"])  # merged through the index
    # The run's last delta makes a third segment (40, 12, 10): merged at once, not left to
    # the next run's first commit; 40 is no more than twice 22, so all three.
    assert refresh_key_index(table, "id", POLICY) == "merged" and stats(table) == (1, 0)
    assert refresh_key_index(table, "id", POLICY) == ""
    assert len(unique_ids(table)) == 52


@pytest.mark.parametrize(("sizes", "merged"), [
    ([5, 5], 2), ([10_000, 100, 200, 300], 3), ([1000, 100, 200, 300], 4),
    ([800, 400, 200, 100, 50, 25, 12, 6], 8), ([10**6, 70_000, 65_536, 30_000, 5_000], 4),
    ([10**6, 10**5, 500, 500], 2)])
def test_segments_are_merged_size_tiered(sizes, merged):
    assert segments_to_merge(sizes) == merged


def test_an_append_overtaken_by_a_merge_of_the_same_keys_keeps_the_first_copy(tmp_path):
    table = TableRef.of(tmp_path / "t.lance")
    append_new(table, rows(0, 5), SCHEMA, ["id"], None)
    upsert(table, rows(5, 8, 1), SCHEMA, ["id"])  # another writer, version 2
    version, clean = append_new(table, rows(6, 10, 2), SCHEMA, ["id"], 1)  # selected at 1
    assert not clean and version == table.latest_version()
    got = unique_ids(table)
    assert {k: got[k] for k in ("k005", "k006", "k007", "k008", "k009")} == \
        {"k005": 1, "k006": 1, "k007": 1, "k008": 2, "k009": 2}
    assert drop_later_copies(table, ["id"], pa.table({"id": ["k006", "k008"]})) is None


def test_a_merge_rebased_over_an_append_of_the_same_keys_keeps_the_first_copy(
        tmp_path, monkeypatch):
    """The merge is computed on version 1, then an append of the same keys commits first:
    Lance rebases the merge over it (no conflict between the two kinds), and the upsert
    finds and drops its later copies."""
    table = TableRef.of(tmp_path / "t.lance")
    append_new(table, rows(0, 3), SCHEMA, ["id"], None)
    appended = []

    def an_append_commits_first(name: str) -> None:
        if not appended:
            appended.append(append_new(table, rows(3, 6, 7), SCHEMA, ["id"], 1))

    monkeypatch.setattr(lance_tables, "failpoint", an_append_commits_first)
    upsert(table, rows(4, 8, 9), SCHEMA, ["id"])
    assert appended == [(2, True)]
    got = unique_ids(table)
    assert [got[f"k{i:03d}"] for i in range(3, 8)] == [7, 7, 7, 9, 9]
