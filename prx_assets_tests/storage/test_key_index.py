"""The key index's upkeep, appends of new rows, and the repair when a concurrent writer
brought the same keys (no Ray: plain Lance commits)."""

from __future__ import annotations

import pyarrow as pa

from prx_assets.storage import lance_tables
from prx_assets.storage.key_index import (
    KeyIndexPolicy,
    key_index_stats,
    maintain_key_index,
    refresh_key_index,
)
from prx_assets.storage.lance_tables import append_new, drop_later_copies, upsert
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
    version, clean = append_new(table, rows(0, 8), SCHEMA, "id", None)
    assert (version, clean) == (1, True)
    assert maintain_key_index(table, "id", POLICY) == "" and stats(table) is None  # 8 < 10
    append_new(table, rows(8, 12), SCHEMA, "id", 1)
    assert maintain_key_index(table, "id", POLICY) == "created" and stats(table) == (1, 0)
    append_new(table, rows(12, 15), SCHEMA, "id", table.latest_version())
    assert maintain_key_index(table, "id", POLICY) == ""  # 3 unindexed rows: within the lag
    append_new(table, rows(15, 18), SCHEMA, "id", table.latest_version())
    assert maintain_key_index(table, "id", POLICY) == "delta" and stats(table) == (2, 0)
    append_new(table, rows(18, 24), SCHEMA, "id", table.latest_version())
    assert maintain_key_index(table, "id", POLICY) == "delta" and stats(table) == (3, 0)
    # The newest two merged into one; the oldest, biggest left alone.
    assert maintain_key_index(table, "id", POLICY) == "merged" and stats(table) == (2, 0)
    upsert(table, rows(20, 30, 1), SCHEMA, ["id"])  # merged through the index
    assert refresh_key_index(table, "id", POLICY) == "delta" and stats(table) == (3, 0)
    assert refresh_key_index(table, "id", POLICY) == "merged" and stats(table) == (2, 0)
    assert refresh_key_index(table, "id", POLICY) == ""
    assert len(unique_ids(table)) == 30


def test_an_append_overtaken_by_a_merge_of_the_same_keys_keeps_the_first_copy(tmp_path):
    table = TableRef.of(tmp_path / "t.lance")
    append_new(table, rows(0, 5), SCHEMA, "id", None)
    upsert(table, rows(5, 8, 1), SCHEMA, ["id"])  # another writer, version 2
    version, clean = append_new(table, rows(6, 10, 2), SCHEMA, "id", 1)  # selected at 1
    assert not clean and version == table.latest_version()
    got = unique_ids(table)
    assert {k: got[k] for k in ("k005", "k006", "k007", "k008", "k009")} == \
        {"k005": 1, "k006": 1, "k007": 1, "k008": 2, "k009": 2}
    assert drop_later_copies(table, "id", pa.array(["k006", "k008"])) is None


def test_a_merge_rebased_over_an_append_of_the_same_keys_keeps_the_first_copy(
        tmp_path, monkeypatch):
    """The merge is computed on version 1, then an append of the same keys commits first:
    Lance rebases the merge over it (no conflict between the two kinds), and the upsert
    finds and drops its later copies."""
    table = TableRef.of(tmp_path / "t.lance")
    append_new(table, rows(0, 3), SCHEMA, "id", None)
    appended = []

    def an_append_commits_first(name: str) -> None:
        if not appended:
            appended.append(append_new(table, rows(3, 6, 7), SCHEMA, "id", 1))

    monkeypatch.setattr(lance_tables, "failpoint", an_append_commits_first)
    upsert(table, rows(4, 8, 9), SCHEMA, ["id"])
    assert appended == [(2, True)]
    got = unique_ids(table)
    assert [got[f"k{i:03d}"] for i in range(3, 8)] == [7, 7, 7, 9, 9]
