"""Blob tables free the files of superseded versions after a short grace, not a week: a
reader of an older version keeps working within the grace, and gets a clear error after."""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pytest

from prx_assets.storage.lance_tables import (
    FragmentPolicy,
    append_rows,
    cleanup,
    compact,
)
from prx_assets.storage.reads import data_bytes
from prx_assets.storage.refs import TableRef, VersionRemovedError
from prx_assets.storage.retention import blob_grace, superseded_versions

SCHEMA = pa.schema([("id", pa.string()), ("image", pa.large_binary())])


def blobs(start: int, stop: int) -> pa.Table:
    return pa.table({"id": [f"i{i:03d}" for i in range(start, stop)],
                     "image": [bytes([i % 256]) * 20_000 for i in range(start, stop)]},
                    schema=SCHEMA)


def on_disk(table: TableRef) -> int:
    return sum(p.stat().st_size for p in Path(table.uri).rglob("*") if p.is_file())


def compacted_table(tmp_path: Path) -> tuple[TableRef, TableRef]:
    """A table of five small appends compacted into one fragment; and itself pinned at the
    last version before the compaction (a reader that pinned it then)."""
    table = TableRef.of(tmp_path / "blobs.lance")
    for start in range(0, 50, 10):
        append_rows(table, blobs(start, start + 10), SCHEMA)
    pinned = table.pinned()
    assert compact(table, FragmentPolicy()) == 5
    return table, pinned


def test_superseded_means_a_newer_version_came_at_least_the_grace_ago():
    now = datetime(2026, 12, 2, 12, 0)
    versions = [{"version": v, "timestamp": now - timedelta(minutes=m)}
                for v, m in ((1, 60), (2, 30), (3, 5), (4, 1))]
    assert superseded_versions(versions, timedelta(minutes=10), now) == [1]
    assert superseded_versions(versions, timedelta(0), now) == [1, 2, 3]
    assert superseded_versions(versions[-1:], timedelta(0), now) == []


def test_within_the_grace_an_older_version_stays_readable(tmp_path):
    table, pinned = compacted_table(tmp_path)
    cleanup(table.open(), FragmentPolicy(superseded_grace=timedelta(hours=1)))
    assert pinned.to_table().num_rows == 50
    assert on_disk(table) > 1.8 * data_bytes(table.open())  # both copies still there


def test_after_the_grace_the_files_are_freed_and_a_reader_is_told_why(tmp_path):
    table, pinned = compacted_table(tmp_path)
    opened_before = pinned.open()  # a reader that opened it before the cleanup ran
    cleanup(table.open(), FragmentPolicy(superseded_grace=timedelta(0)))
    assert on_disk(table) <= 1.2 * data_bytes(table.open())
    assert table.to_table().num_rows == 50  # the latest version is whole
    with pytest.raises(VersionRemovedError, match=f"version {pinned.version} was removed"):
        pinned.to_table()
    with pytest.raises(VersionRemovedError, match="PRX_BLOB_GRACE_S"):
        pinned.open()
    # A LanceDataset opened before, read without its handle: Lance's own missing-file error.
    with pytest.raises((OSError, ValueError), match="Not found"):
        opened_before.to_table()


def test_the_grace_is_configurable(monkeypatch):
    monkeypatch.delenv("PRX_BLOB_GRACE_S", raising=False)
    assert blob_grace() == timedelta(minutes=10)
    monkeypatch.setenv("PRX_BLOB_GRACE_S", "30")
    assert blob_grace() == timedelta(seconds=30)


def test_a_held_version_outlives_the_grace_until_its_holder_moves_on(tmp_path):
    from prx_assets.storage.retention import hold_version

    table, pinned = compacted_table(tmp_path)
    hold_version(table, "captions", pinned.version)
    hold_version(table, "captions", pinned.version)  # the same again: no error
    policy = FragmentPolicy(superseded_grace=timedelta(0), keep_versions=timedelta(0))
    cleanup(table.open(), policy)  # tagged versions are skipped, not an error
    assert pinned.to_table().num_rows == 50
    hold_version(table, "captions", table.latest_version())  # the holder moves on
    cleanup(table.open(), policy)
    with pytest.raises(VersionRemovedError):
        pinned.to_table()
    assert on_disk(table) <= 1.2 * data_bytes(table.open())


def test_a_version_held_while_a_run_reads_it_is_freed_after(tmp_path):
    from prx_assets.storage.retention import held_while

    table, pinned = compacted_table(tmp_path)
    policy = FragmentPolicy(superseded_grace=timedelta(0), keep_versions=timedelta(0))
    with pytest.raises(RuntimeError, match="the run failed"), \
            held_while(table, "captions-run", pinned.version):
        cleanup(table.open(), policy)  # another run's cleanup, while this one reads
        assert pinned.to_table().num_rows == 50
        raise RuntimeError("the run failed")
    cleanup(table.open(), policy)  # released however the run ended
    with pytest.raises(VersionRemovedError):
        pinned.to_table()
