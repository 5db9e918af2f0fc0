"""Two-step writes: files first, uncommitted, then one commit of the whole new version."""

from pathlib import Path

import pyarrow as pa

from prx_assets.storage.lance_tables import overwrite_rows
from prx_assets.storage.refs import TableRef
from prx_assets.storage.replace import overwrite_with, write_uncommitted

OLD = pa.schema([("id", pa.string())])
NEW = pa.schema([("id", pa.string()), ("fingerprint", pa.int64())])


def test_files_staged_whole_change_nothing_until_committed_even_in_a_new_schema(tmp_path: Path):
    table = TableRef.of(tmp_path / "t.lance")
    first = overwrite_rows(table, pa.table({"id": ["a", "b"]}, schema=OLD), OLD)
    staged = [write_uncommitted(table, [pa.table({"id": [i], "fingerprint": [n]}, schema=NEW)],
                                NEW, whole=True)[0] for n, i in enumerate(["c", "d"])]
    assert table.latest_version() == first
    assert table.latest().to_table()["id"].to_pylist() == ["a", "b"]
    version = overwrite_with(table, NEW, [f for fragments in staged for f in fragments])
    assert version == first + 1
    assert table.latest().to_table().to_pylist() == [{"id": "c", "fingerprint": 0},
                                                     {"id": "d", "fingerprint": 1}]
    assert table.at(first).to_table()["id"].to_pylist() == ["a", "b"]  # the old version stays
