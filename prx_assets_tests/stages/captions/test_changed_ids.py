"""Which raw items' captions are stale: none after an append (no pass over the versions),
the replaced item after an update, also when the update came with compaction."""

import pyarrow as pa
import pytest

from prx_assets.stages.captions import runs
from prx_assets.storage.lance_tables import append_rows, only_appended_since
from prx_assets.storage.refs import TableRef

RAW = pa.schema([("id", pa.string()), ("sha256", pa.string()),
                 ("original_caption", pa.string())])


def rows(*items: tuple[str, str]) -> pa.Table:
    return pa.Table.from_pylist([{"id": i, "sha256": sha, "original_caption": f"about {i}"}
                                 for i, sha in items], schema=RAW)


@pytest.fixture
def raw(tmp_path) -> TableRef:
    table = TableRef.of(tmp_path / "raw_images.lance")
    append_rows(table, rows(("a", "1"), ("b", "2")), RAW)
    return table


def test_an_append_is_told_apart_from_a_delete_and_a_compaction(raw):
    first = raw.latest_version()
    appended = append_rows(raw, rows(("c", "3")), RAW)
    assert only_appended_since(raw, first, appended)
    assert only_appended_since(raw, appended, appended)
    raw.open().delete("id = 'a'")
    assert not only_appended_since(raw, appended, raw.latest_version())
    compacted_from = append_rows(raw, rows(("d", "4")), RAW)
    raw.open().optimize.compact_files(target_rows_per_fragment=1 << 20)
    assert not only_appended_since(raw, compacted_from, raw.latest_version())


def test_an_appended_item_makes_no_caption_stale_without_reading_the_rows(raw, monkeypatch):
    first = raw.latest_version()
    appended = append_rows(raw, rows(("c", "3")), RAW)

    def no_pass(*args, **kwargs):
        raise AssertionError("the versions were read row by row")

    monkeypatch.setattr(runs, "_item_keys", no_pass)
    assert runs.changed_ids(raw, first, appended, with_caption=True) == set()


def test_a_replaced_item_is_still_found_after_an_append_and_a_compaction(ray_session, raw):
    first = raw.latest_version()
    append_rows(raw, rows(("c", "3")), RAW)
    raw.open().delete("id = 'b'")
    append_rows(raw, rows(("b", "22")), RAW)  # same key path, new bytes
    raw.open().optimize.compact_files(target_rows_per_fragment=1 << 20)
    assert runs.changed_ids(raw, first, raw.latest_version(), with_caption=True) == {"b"}
