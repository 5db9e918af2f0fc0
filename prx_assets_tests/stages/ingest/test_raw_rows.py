"""Raw rows whose reservations are read a block at a time (`defer_rights`): the same rows
as read one at a time, and reserved until read (fail closed)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from prx_assets.stages.ingest.raw_rows import (
    RAW_IMAGES_SCHEMA,
    UNREAD_SIGNAL,
    FoundItem,
    raw_row,
    read_reservations,
    rows_to_tables,
)
from prx_assets.stages.ingest.rights import NONE, PROHIBITED
from prx_assets.testing import rights_fixtures as rf


def test_a_deferred_row_is_reserved_until_its_reservation_is_read():
    item = FoundItem(key="a", data=rf.photo("jpeg", 48), meta={"license": "cc0"})
    row = raw_row("src", item, defer_rights=True)
    assert (row["reservation"], row["reservation_signal"]) == (PROHIBITED, UNREAD_SIGNAL)
    # A table made without reading it (a path that skipped `read_reservations`) reserves
    # the row, and carries nothing of the pending sidecar.
    unread = pa.Table.from_pylist([row], schema=RAW_IMAGES_SCHEMA)
    assert unread.column("reservation").to_pylist() == [PROHIBITED]
    read_reservations([row])
    assert (row["reservation"], row["reservation_signal"]) == (NONE, None)
    assert set(row) == set(RAW_IMAGES_SCHEMA.names)
    assert raw_row("src", item, read_rights=False, defer_rights=True)["reservation"] == NONE


@pytest.mark.skipif(not rf.exiftool_available(), reason="exiftool not installed")
def test_rows_read_in_blocks_are_the_rows_read_one_at_a_time(tmp_path: Path):
    pytest.importorskip("c2pa")
    samples = rf.signal_samples(tmp_path, size=96)
    items = [FoundItem(key=s.key, data=s.data, meta=s.sidecar) for s in samples]
    items.append(FoundItem(key="empty", data=b"", meta={"X-Robots-Tag": "noai"}))
    one_at_a_time = [raw_row("src", item) for item in items]
    deferred = [raw_row("src", item, defer_rights=True) for item in items]
    tables = list(rows_to_tables(deferred, max_rows=4))
    assert [t.num_rows for t in tables] == [4, 4, 3]
    assert pa.concat_tables(tables).to_pylist() == pa.Table.from_pylist(
        one_at_a_time, schema=RAW_IMAGES_SCHEMA).to_pylist()
    assert [row["reservation"] for row in deferred[:-1]] == [s.status for s in samples]
