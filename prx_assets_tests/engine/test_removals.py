"""Deleting the rows of ids gone upstream: bounded filters, one commit per batch of ids,
no commit when nothing matches."""

import lance
import pyarrow as pa

from prx_assets.engine.removals import delete_ids, removed_ids
from prx_assets.storage.refs import TableRef


def test_ids_gone_upstream_are_deleted_in_bounded_commits(tmp_path):
    target = TableRef.of(tmp_path / "target.lance")
    upstream = TableRef.of(tmp_path / "upstream.lance")
    lance.write_dataset(pa.table({"id": [f"s:{i}" for i in range(10)]}), target.uri)
    lance.write_dataset(pa.table({"id": [f"s:{i}" for i in range(5, 12)]}), upstream.uri)
    gone = removed_ids(target, upstream.pinned())
    assert sorted(gone.to_pylist()) == [f"s:{i}" for i in range(5)]
    version = target.latest_version()
    assert delete_ids(target, gone, per_commit=2) == 5
    assert target.latest_version() == version + 3  # ceil(5 / 2) deletes
    assert sorted(target.to_table(columns=["id"]).column("id").to_pylist()) == \
        [f"s:{i}" for i in range(5, 10)]
    assert delete_ids(target, gone) == 0
    assert target.latest_version() == version + 3  # nothing matched: no commit


def test_nothing_is_removed_from_a_table_that_does_not_exist(tmp_path):
    upstream = TableRef.of(tmp_path / "upstream.lance")
    lance.write_dataset(pa.table({"id": ["a"]}), upstream.uri)
    assert len(removed_ids(TableRef.of(tmp_path / "none.lance"), upstream)) == 0
    assert delete_ids(TableRef.of(tmp_path / "none.lance"), pa.array(["a"])) == 0
