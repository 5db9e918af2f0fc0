"""Pending rows selected by looking the offered ids up in the target (through its key
index, inside the tasks) select exactly what a plain set difference does: duplicates among
the offered rows kept, nothing offered, an empty table, and the fallback to reading the
committed ids when the index would leave too much to scan."""

from __future__ import annotations

import lance
import pyarrow as pa
import pytest

import prx_assets.engine.chunked as chunked
from prx_assets.engine.chunked import committed_among, pending_new_rows, pending_rows
from prx_assets.storage.key_index import index_name, serves_lookups
from prx_assets.storage.refs import TableRef
from prx_assets_tests.engine.test_chunked import IDS, SCHEMA, inputs, square

COMMITTED = IDS[3:17:2]  # s:003, s:005, ... s:015
OFFERED = IDS[:8] + IDS[:3] + IDS[12:] + ["s:999"]  # three ids twice, one never seen


def committed_table(tmp_path, ids=COMMITTED, indexed: bool = True) -> TableRef:
    uri = str(tmp_path / "out.lance")
    dataset = lance.write_dataset(square(pa.table({"id": pa.array(ids, pa.string())})), uri,
                                  schema=SCHEMA)
    if indexed:
        dataset.create_scalar_index("id", "BTREE", name=index_name("id"))
    return TableRef.of(uri)


def set_difference(offered: list[str], committed: list[str]) -> list[str]:
    return sorted(i for i in offered if i not in set(committed))


def forbid_reading_committed_ids(monkeypatch) -> None:
    def read_all(*args, **kwargs):
        raise AssertionError("the committed ids were read: the lookups were not used")

    monkeypatch.setattr(chunked, "committed_ids", read_all)


@pytest.mark.parametrize("per_query", [1, 3, 8192])
def test_committed_among_finds_exactly_the_committed_offered_ids(tmp_path, per_query):
    dataset = committed_table(tmp_path).open()
    found = committed_among(dataset, pa.chunked_array([OFFERED[:9], OFFERED[9:]]), per_query)
    assert sorted(found.to_pylist()) == sorted(set(OFFERED) & set(COMMITTED))
    assert committed_among(dataset, pa.array([], pa.string())).to_pylist() == []


def test_committed_among_an_empty_table_finds_nothing(tmp_path):
    dataset = committed_table(tmp_path, ids=[], indexed=False).open()
    assert committed_among(dataset, pa.array(OFFERED)).to_pylist() == []


def test_an_indexed_target_is_asked_about_the_offered_ids_only(ray_session, tmp_path,
                                                                 monkeypatch):
    table = committed_table(tmp_path)
    forbid_reading_committed_ids(monkeypatch)
    pending = pending_rows(inputs(OFFERED), table)
    assert sorted(pending.to_pandas()["id"]) == set_difference(OFFERED, COMMITTED)
    pending, new = pending_new_rows(inputs(OFFERED), table)
    assert new.version == table.latest_version()
    assert sorted(pending.to_pandas()["id"]) == set_difference(OFFERED, COMMITTED)


def test_the_lookups_read_the_version_selected_not_a_later_one(ray_session, tmp_path,
                                                                 monkeypatch):
    table = committed_table(tmp_path)
    forbid_reading_committed_ids(monkeypatch)
    pending, _ = pending_new_rows(inputs(OFFERED), table)
    # Lazy: another writer commits before the selection runs; the version selected holds.
    lance.write_dataset(square(pa.table({"id": ["s:999"]})), table.uri, mode="append")
    assert sorted(pending.to_pandas()["id"]) == set_difference(OFFERED, COMMITTED)


def test_too_many_unindexed_rows_or_a_done_filter_read_the_committed_ids(ray_session,
                                                                         tmp_path):
    table = committed_table(tmp_path)
    lance.write_dataset(square(pa.table({"id": ["s:999"]})), table.uri, mode="append")
    dataset = table.open()
    assert serves_lookups(dataset, "id")
    assert not serves_lookups(dataset, "id", max_unindexed_rows=0)
    assert not serves_lookups(committed_table(tmp_path / "plain", indexed=False).open(), "id")
    # The done filter narrows what counts as committed: the set difference with those.
    pending = pending_rows(inputs(OFFERED), table, done_filter="id < 's:010'")
    done = [i for i in [*COMMITTED, "s:999"] if i < "s:010"]
    assert sorted(pending.to_pandas()["id"]) == set_difference(OFFERED, done)


def test_no_table_or_an_empty_one_leaves_every_offered_row(ray_session, tmp_path):
    absent = TableRef.of(tmp_path / "absent.lance")
    assert sorted(pending_rows(inputs(OFFERED), absent).to_pandas()["id"]) == sorted(OFFERED)
    empty = committed_table(tmp_path, ids=[], indexed=False)
    assert sorted(pending_rows(inputs(OFFERED), empty).to_pandas()["id"]) == sorted(OFFERED)

