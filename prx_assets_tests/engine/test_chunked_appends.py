"""Chunked runs that append rows known to be new and look the others up through a key
index: the index exists after the write and stays current through appends and compaction,
a rerun doubles nothing, and another writer committing the same keys mid-run leaves each
key once."""

from __future__ import annotations

import lance
import pyarrow as pa
import pytest

from prx_assets.engine.chunked import (
    ChunkedRun,
    CommitTarget,
    NewRows,
    pending_new_rows,
    run_chunked,
)
from prx_assets.storage.key_index import KeyIndexPolicy, index_name, key_index_stats
from prx_assets.storage.lance_tables import FragmentPolicy, upsert
from prx_assets_tests.engine.test_chunked import IDS, SCHEMA, inputs, square, stage

# Small enough that twenty rows in chunks of three make, delta-update and merge an index.
EAGER_INDEX = FragmentPolicy(key_index=KeyIndexPolicy(min_rows=0, max_unindexed_rows=4,
                                                      max_segments=3))


def target(tmp_path, policy: FragmentPolicy = EAGER_INDEX) -> CommitTarget:
    from prx_assets.storage.refs import TableRef

    return CommitTarget(TableRef.of(tmp_path / "out.lance"), SCHEMA, ["id"], policy)


def ids(out: CommitTarget) -> list[str]:
    return out.table.to_table(columns=["id"]).column("id").to_pylist()


def uses_the_index(dataset: lance.LanceDataset) -> bool:
    plan = dataset.scanner(filter="id = 's:007'").explain_plan()
    return f"ScalarIndexQuery: query=[id = s:007]@{index_name('id')}" in plan


def test_new_rows_are_appended_and_the_key_index_kept_current(ray_session, tmp_path):
    out = target(tmp_path)
    unindexed: list[int] = []

    def watch(chunk: pa.Table, run: ChunkedRun) -> None:
        stats = key_index_stats(out.open(), "id")
        unindexed.append(stats["num_unindexed_rows"] if stats else run.committed)

    pending, new = pending_new_rows(inputs(), out.table)
    assert new == NewRows(None)  # no table yet
    run = run_chunked(pending, stage(), out, chunk_rows=3, on_chunk=watch, new_rows=new)

    assert (run.committed, run.appended, run.commits) == (20, 20, 7)
    assert max(unindexed) <= 4 + 3  # never more than the lag plus one chunk unindexed
    assert run.index_updates >= 3
    table = out.open()
    assert sorted(ids(out)) == IDS
    stats = key_index_stats(table, "id")
    assert stats is not None and stats["num_unindexed_rows"] == 0
    # Compacted after each index update: a fragment per index segment (Lance compacts
    # together only fragments one segment covers), the index remapped; so healthy at the
    # end, and not compacted again (`needs_compaction`).
    assert run.compacted_from is None
    assert len(table.get_fragments()) <= stats["num_segments"] <= 3
    assert uses_the_index(table)
    assert table.to_table(filter="id = 's:007'").column("value").to_pylist() == [49]


def test_a_rerun_appends_nothing_and_a_merge_of_the_same_rows_doubles_none(
        ray_session, tmp_path):
    out = target(tmp_path)
    pending, new = pending_new_rows(inputs(), out.table)
    run_chunked(pending, stage(), out, chunk_rows=6, new_rows=new)

    pending, new = pending_new_rows(inputs(), out.table)
    assert new.version == out.version() and pending.count() == 0
    rerun = run_chunked(pending, stage(), out, chunk_rows=6, new_rows=new)
    assert rerun.commits == 0

    # Rows that may exist are merged through the index: replaced, never doubled.
    merged = run_chunked(inputs([*IDS[:8], "s:099"]), stage(), out, chunk_rows=4)
    assert (merged.committed, merged.appended) == (9, 0)
    assert sorted(ids(out)) == sorted([*IDS, "s:099"])
    assert key_index_stats(out.open(), "id")["num_unindexed_rows"] == 0


def test_another_writer_committing_the_same_keys_mid_run_leaves_each_key_once(
        ray_session, tmp_path):
    """After this run's first chunk, another writer commits rows of its second chunk: the
    second append lands on a version it did not start from, so its keys are checked and
    the later copies dropped (the other writer's rows, committed first, stay); the run
    merges from then on."""
    out = target(tmp_path, FragmentPolicy(key_index=KeyIndexPolicy(enabled=False)))

    def other_writer(chunk: pa.Table, run: ChunkedRun) -> None:
        if run.chunks == 1:
            upsert(out.table, square(pa.table({"id": IDS[5:8]})).set_column(
                1, "value", pa.array([-1] * 3, pa.int64())), SCHEMA, ["id"])

    pending, new = pending_new_rows(inputs(), out.table)
    run = run_chunked(pending, stage(), out, chunk_rows=5, on_chunk=other_writer,
                      new_rows=new)
    assert run.appended == 5 and run.committed == 20
    assert sorted(ids(out)) == IDS  # each key once
    values = out.table.to_table(filter="id IN ('s:005', 's:006', 's:007', 's:008')")
    assert dict(zip(values.column("id").to_pylist(), values.column("value").to_pylist(),
                    strict=True)) == {"s:005": -1, "s:006": -1, "s:007": -1, "s:008": 64}


@pytest.mark.parametrize("keys", [["id"], ["id", "value"]])
def test_a_target_on_several_keys_is_appended_and_indexed_on_its_first(ray_session, tmp_path,
                                                                        keys):
    """Lance's merge-insert cannot look a key of several columns up through an index, so
    such a target gets the index on its first key all the same: the writer looks its rows
    up through it (`upsert_looked_up`), and appends rows known new like any target."""
    out = CommitTarget(target(tmp_path).table, SCHEMA, keys, EAGER_INDEX)
    pending, new = pending_new_rows(inputs(), out.table)
    run = run_chunked(pending, stage(), out, chunk_rows=10, new_rows=new)
    assert run.appended == 20 and sorted(ids(out)) == IDS
    assert key_index_stats(out.open(), "id") is not None
