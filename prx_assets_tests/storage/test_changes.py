"""What changed in a Lance table since a record of what was consumed: appends, deletes,
merge-inserts, compaction, versions freed by cleanup, and the record in a table's config."""

import threading
from datetime import timedelta

import lance
import pyarrow as pa

from prx_assets.storage.changes import (
    Consumed,
    changes_since,
    consumed_at,
    forget_consumed,
    forget_large_record,
    read_consumed,
    read_large_record,
    record_consumed,
    rows_with_ids,
    scan_rows_with_ids,
    write_large_record,
)
from prx_assets.storage.refs import TableRef


def rows(ids: list[str], value: int = 0) -> pa.Table:
    return pa.table({"id": ids, "v": [value] * len(ids)})


def upsert(path: str, table: pa.Table) -> None:
    lance.dataset(path).merge_insert("id").when_matched_update_all() \
        .when_not_matched_insert_all().execute(table)


def added(table: lance.LanceDataset, since: Consumed) -> list[str]:
    changes = changes_since(table, since)
    ids = table.to_table(columns=["id"], filter=changes.added_filter).column("id").to_pylist()
    assert changes.added_rows == len(ids)
    return sorted(ids)


def test_appends_deletes_and_updates(tmp_path):
    path = str(tmp_path / "t.lance")
    since = consumed_at(lance.write_dataset(rows([f"i{n}" for n in range(10)]), path))
    lance.write_dataset(rows(["n1", "n2"]), path, mode="append")
    lance.dataset(path).delete("id IN ('i3', 'n2')")  # n2: added and gone since
    upsert(path, rows(["i4"], value=1))
    table = lance.dataset(path)
    assert added(table, since) == ["i4", "n1"]
    assert changes_since(table, since).removed.to_pylist() == ["i3"]


def test_nothing_changed(tmp_path):
    path = str(tmp_path / "t.lance")
    table = lance.write_dataset(rows(["a", "b"]), path)
    changes = changes_since(table, consumed_at(table))
    assert (changes.added_rows, len(changes.removed)) == (0, 0)


def test_an_id_deleted_before_the_record_and_added_again_is_not_removed(tmp_path):
    path = str(tmp_path / "t.lance")
    lance.write_dataset(rows(["a", "b", "c"]), path)
    lance.dataset(path).delete("id = 'a'")
    lance.write_dataset(rows(["a"]), path, mode="append")
    since = consumed_at(lance.dataset(path))
    lance.dataset(path).delete("id = 'b'")  # the first fragment's deletions grow
    # its deleted rows are a (held elsewhere) and b: only b left
    assert changes_since(lance.dataset(path), since).removed.to_pylist() == ["b"]


def test_a_deleted_row_of_an_id_with_another_row_is_deleted_not_removed(tmp_path):
    path = str(tmp_path / "t.lance")
    since = consumed_at(lance.write_dataset(pa.table({"id": ["a", "a", "b"],
                                                      "v": [1, 2, 0]}), path))
    lance.dataset(path).delete("id = 'a' AND v = 2")  # a's other row (version 1) stays
    changes = changes_since(lance.dataset(path), since)
    assert changes.removed.to_pylist() == [] and changes.deleted.to_pylist() == ["a"]


def test_compaction_leaves_removals_unknown(tmp_path):
    path = str(tmp_path / "t.lance")
    lance.write_dataset(rows(["a", "b"]), path)
    lance.write_dataset(rows(["c"]), path, mode="append")
    since = consumed_at(lance.dataset(path))
    lance.dataset(path).delete("id = 'a'")
    lance.dataset(path).optimize.compact_files()
    table = lance.dataset(path)
    assert changes_since(table, since).removed is None
    assert added(table, since) == ["b", "c"]  # moved: the caller's pending check drops them


def test_the_record_needs_no_old_version(tmp_path):
    path = str(tmp_path / "t.lance")
    since = consumed_at(lance.write_dataset(rows(["a", "b", "c"]), path))
    lance.dataset(path).delete("id = 'b'")
    lance.write_dataset(rows(["d"]), path, mode="append")
    table = lance.dataset(path)
    table.cleanup_old_versions(older_than=timedelta(0))
    assert [v["version"] for v in table.versions()] == [table.version]
    assert changes_since(table, since).removed.to_pylist() == ["b"]
    assert added(table, since) == ["d"]


def test_the_record_round_trips_and_is_per_upstream_and_tag(tmp_path):
    target = TableRef.of(tmp_path / "down.lance")
    upstream = lance.write_dataset(rows(["a"]), str(tmp_path / "up.lance"))
    lance.write_dataset(rows(["x"]), target.uri)
    consumed = consumed_at(upstream, tag="s1")
    record_consumed(target, "up", consumed)
    assert read_consumed(target, "up", tag="s1") == consumed
    assert read_consumed(target, "up", tag="s2") is None
    assert read_consumed(target, "other") is None
    version = target.latest_version()
    record_consumed(target, "up", consumed)  # the same record: no commit
    assert target.latest_version() == version
    forget_consumed(target)
    assert read_consumed(target, "up", tag="s1") is None


def test_a_large_record_lives_beside_the_table_with_only_its_name_in_the_config(tmp_path):
    target = TableRef.of(tmp_path / "down.lance")
    lance.write_dataset(rows(["x"]), target.uri)
    big = "c" * 1_000_000  # a fit's arrays
    write_large_record(target, "prx.fit", big)
    assert read_large_record(target, "prx.fit") == big
    assert len(target.open().config()["prx.fit"]) < 100  # every open reads the config
    folder = tmp_path / "down.lance" / "_prx_records"
    version = target.latest_version()
    write_large_record(target, "prx.fit", big)  # the same record: no commit
    assert target.latest_version() == version

    write_large_record(target, "prx.fit", "d")
    assert read_large_record(target, "prx.fit") == "d"
    assert len(list(folder.iterdir())) == 1  # the replaced record's file is gone
    assert target.open().to_table().column("id").to_pylist() == ["x"]  # Lance unbothered
    target.open().cleanup_old_versions(older_than=timedelta(0), delete_unverified=True)
    assert read_large_record(target, "prx.fit") == "d"  # and its cleanup leaves the file
    forget_large_record(target, "prx.fit")
    assert read_large_record(target, "prx.fit") is None and list(folder.iterdir()) == []


def test_a_large_record_whose_file_is_gone_reads_as_none(tmp_path):
    target = TableRef.of(tmp_path / "down.lance")
    lance.write_dataset(rows(["x"]), target.uri)
    write_large_record(target, "prx.fit", "e")
    for file in (tmp_path / "down.lance" / "_prx_records").iterdir():
        file.unlink()
    assert read_large_record(target, "prx.fit") is None


def test_a_record_rebases_over_writes_and_two_records_race(tmp_path):
    """A record is a config commit on the downstream table: rows committed alongside it
    stay, and two runs recording at once both succeed, leaving one of their records."""
    target = TableRef.of(tmp_path / "down.lance")
    upstream = lance.write_dataset(rows(["a"]), str(tmp_path / "up.lance"))
    lance.write_dataset(rows(["x"]), target.uri)
    stale = target.latest().open()
    lance.write_dataset(rows(["y"]), target.uri, mode="append")
    stale.update_config({"prx.consumed.up": consumed_at(upstream).to_json()})
    assert target.latest().count_rows() == 2

    records = [consumed_at(upstream, tag=t) for t in ("r1", "r2")]
    barrier, errors = threading.Barrier(2), []

    def record(consumed: Consumed) -> None:
        barrier.wait()
        try:
            record_consumed(target, "up2", consumed)
        except Exception as exc:  # any failure is the finding: reported below
            errors.append(exc)
    threads = [threading.Thread(target=record, args=(c,)) for c in records]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert any(read_consumed(target, "up2", tag=c.tag) == c for c in records)


def test_rows_of_ids_scanned_in_batches_equal_those_looked_up(tmp_path):
    path = str(tmp_path / "t.lance")
    table = lance.write_dataset(pa.table({"id": [f"i{n:03d}" for n in range(300)],
                                          "v": list(range(300))}), path, max_rows_per_file=70)
    wanted = pa.array(["i007", "i150", "i299", "absent"])
    scanned = scan_rows_with_ids(table, wanted, ["id", "v"], where="v > 10", with_row_id=True,
                                 batch_rows=32)  # several fragments, several batches each
    looked_up = rows_with_ids(table, wanted, ["id", "v"], where="v > 10", with_row_id=True)
    assert scanned.sort_by("id").to_pylist() == looked_up.sort_by("id").to_pylist()
    assert scanned.column("id").to_pylist() == ["i150", "i299"]
    assert scan_rows_with_ids(table, pa.array([], pa.string()), ["id"]).num_rows == 0
