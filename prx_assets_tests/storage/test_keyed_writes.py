"""Rows found by a key of several columns through the first column's index: which rows a
chunk replaces, and the repair of copies two writers made (no Ray: plain Lance commits)."""

from __future__ import annotations

import lance
import pyarrow as pa

from prx_assets.engine import chunked
from prx_assets.engine.chunked import upsert_looked_up
from prx_assets.storage import keyed_writes, lance_tables
from prx_assets.storage.key_index import KeyIndexPolicy, key_index_stats, maintain_key_index
from prx_assets.storage.keyed_writes import (
    drop_later_copies,
    key_strings,
    rows_with_keys,
    split_present,
)
from prx_assets.storage.lance_tables import append_new, upsert
from prx_assets.storage.refs import TableRef

SCHEMA = pa.schema([("id", pa.string()), ("version", pa.string()), ("v", pa.int64())])
KEYS = ["id", "version"]


def rows(ids: range, version: str = "a", value: int = 0) -> pa.Table:
    return pa.table({"id": [f"k{i:03d}" for i in ids], "version": [version] * len(ids),
                     "v": [value] * len(ids)}, schema=SCHEMA)


def contents(table: TableRef) -> dict[tuple[str, str], int]:
    got = table.to_table().to_pylist()
    keys = [(r["id"], r["version"]) for r in got]
    assert len(keys) == len(set(keys)), "a key written twice"
    return {(r["id"], r["version"]): r["v"] for r in got}


def indexed_table(tmp_path) -> TableRef:
    """k000..k019 under version a, k000..k004 under b, with the key index on `id`."""
    table = TableRef.of(tmp_path / "t.lance")
    upsert(table, rows(range(20)), SCHEMA, KEYS)
    upsert(table, rows(range(5), "b"), SCHEMA, KEYS)
    assert maintain_key_index(table, "id", KeyIndexPolicy(min_rows=10)) == "created"
    assert key_index_stats(table.open(), "id") is not None
    return table


def test_a_key_of_several_columns_is_one_string_per_row():
    got = key_strings(rows(range(2), "v1"), KEYS).to_pylist()
    assert got == ["k000\x1fv1", "k001\x1fv1"]
    assert key_strings(rows(range(2)), ["id"]).to_pylist() == ["k000", "k001"]


def test_rows_are_matched_on_the_whole_key(tmp_path):
    table = indexed_table(tmp_path)
    chunk = pa.concat_tables([rows(range(3, 7), "b"), rows(range(18, 22))])
    present, absent = split_present(table.open(), chunk, KEYS)
    # k005/k006 under b share their id with rows of version a only: new.
    assert sorted(key_strings(present, KEYS).to_pylist()) == [
        "k003\x1fb", "k004\x1fb", "k018\x1fa", "k019\x1fa"]
    assert sorted(absent.column("id").to_pylist()) == ["k005", "k006", "k020", "k021"]
    found = rows_with_keys(table.open(), chunk, KEYS)
    assert found.num_rows == 4 and "_rowaddr" in found.column_names


def test_an_upsert_appends_new_keys_and_merges_only_those_present(tmp_path, monkeypatch):
    table = indexed_table(tmp_path)
    merged: list[int] = []

    def counted_upsert(*args, **kwargs):
        merged.append(args[1].num_rows)
        return upsert(*args, **kwargs)

    monkeypatch.setattr(chunked, "upsert", counted_upsert)
    upsert_looked_up(table, pa.concat_tables([rows(range(3, 7), "b", 1), rows(range(30, 33))]),
                     SCHEMA, KEYS)
    assert merged == [2]  # k003/k004 under b; the five others appended
    got = contents(table)
    assert len(got) == 20 + 5 + 2 + 3
    assert [got[(f"k{i:03d}", "b")] for i in range(7)] == [0, 0, 0, 1, 1, 1, 1]
    assert got[("k003", "a")] == 0  # another version of the same id: untouched
    merged.clear()
    upsert_looked_up(table, rows(range(40, 45), "c"), SCHEMA, KEYS)
    assert merged == [] and len(contents(table)) == 35


def test_an_append_overtaken_by_another_writer_keeps_the_first_copy_of_each_key(tmp_path):
    table = indexed_table(tmp_path)
    seen = table.latest_version()
    upsert_looked_up(table, rows(range(20, 24), "a", 1), SCHEMA, KEYS)  # another writer
    # Selected absent at `seen`: k022/k023 are now doubled, k024 new; k022 under b is new.
    version, clean = append_new(table, pa.concat_tables([
        rows(range(22, 25), "a", 2), rows(range(22, 23), "b", 2)]), SCHEMA, KEYS, seen)
    assert not clean and version == table.latest_version()
    got = contents(table)
    assert [got[(f"k{i:03d}", "a")] for i in range(20, 25)] == [1, 1, 1, 1, 2]
    assert got[("k022", "b")] == 2
    assert drop_later_copies(table, KEYS, rows(range(20, 25))) is None


def test_a_merge_rebased_over_an_append_of_the_same_keys_keeps_the_first_copy(
        tmp_path, monkeypatch):
    """The merge of (k003..k006, b) is computed, then another writer appends two of those
    keys first: Lance rebases the merge over the append, and the upsert drops its later
    copies by the whole key."""
    table = indexed_table(tmp_path)
    appended = []

    def an_append_commits_first(name: str) -> None:
        if not appended:
            appended.append(append_new(table, rows(range(5, 7), "b", 7), SCHEMA, KEYS,
                                       table.latest_version()))

    monkeypatch.setattr(lance_tables, "failpoint", an_append_commits_first)
    upsert(table, rows(range(3, 7), "b", 9), SCHEMA, KEYS)
    assert appended and appended[0][1]
    got = contents(table)
    assert [got[(f"k{i:03d}", "b")] for i in range(3, 7)] == [9, 9, 7, 7]
    assert [got[(f"k{i:03d}", "a")] for i in range(3, 7)] == [0, 0, 0, 0]


def test_later_copies_are_found_again_by_key_when_a_compaction_lands_first(
        tmp_path, monkeypatch):
    """Row addresses name rows within one version only: a compaction committing between the
    lookup and the delete once left the copies in place (or could hit other rows); the delete
    now lands only on the version it read, and is redone by key after the compaction."""
    table = TableRef.of(tmp_path / "t.lance")
    upsert(table, rows(range(10)), SCHEMA, KEYS)
    lance.write_dataset(rows(range(5, 12), "a", 1), table.uri, mode="append")  # two copies
    compacted = []

    def a_compaction_commits_first(name: str) -> None:
        if name == "storage.copies_found" and not compacted:
            compacted.append(table.open().optimize.compact_files(
                target_rows_per_fragment=1_000, num_threads=1))

    monkeypatch.setattr(keyed_writes, "failpoint", a_compaction_commits_first)
    assert drop_later_copies(table, KEYS, rows(range(5, 12))) == table.latest_version()
    assert compacted
    got = contents(table)  # each key once
    assert [got[(f"k{i:03d}", "a")] for i in range(12)] == [0] * 10 + [1, 1]
