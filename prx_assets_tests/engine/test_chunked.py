"""The chunked-commit runner on a toy stage: what a kill keeps, what a rerun redoes, and
that a table's keys are unique at every version it passes through."""

from collections import Counter

import lance
import pyarrow as pa
import pyarrow.compute as pc
import pytest
import ray.data

from prx_assets.engine.chunked import (
    ChunkedReport,
    ChunkedRun,
    CommitTarget,
    drop_ids,
    hash_partitions,
    pending_rows,
    run_chunked,
    without_ids,
)
from prx_assets.storage.refs import TableRef

SCHEMA = pa.schema([pa.field("id", pa.string(), nullable=False), pa.field("value", pa.int64()),
                    pa.field("ok", pa.bool_())])
IDS = [f"s:{i:03d}" for i in range(20)]


class Killed(Exception):
    pass


def inputs(ids=IDS) -> ray.data.Dataset:
    return ray.data.from_arrow(pa.table({"id": ids}))


def square(batch: pa.Table, fail: frozenset = frozenset()) -> pa.Table:
    ids = batch.column("id").to_pylist()
    return pa.table({"id": ids, "value": [int(i[2:]) ** 2 for i in ids],
                     "ok": [i not in fail for i in ids]}, schema=SCHEMA)


def stage(fail: frozenset = frozenset()):
    return lambda rows: rows.map_batches(square, fn_kwargs={"fail": fail},
                                         batch_format="pyarrow")


def target(tmp_path) -> CommitTarget:
    return CommitTarget(TableRef.of(tmp_path / "out.lance"), SCHEMA, ["id"])


def ids_at_every_version(uri) -> list[list[str]]:
    table = lance.dataset(str(uri))
    return [lance.dataset(str(uri), version=v["version"]).to_table(columns=["id"])
            .column("id").to_pylist() for v in table.versions()]


def test_a_killed_run_keeps_its_chunks_and_the_rerun_does_only_the_rest(ray_session, tmp_path):
    out = target(tmp_path)

    def kill_after_two(chunk: pa.Table, run: ChunkedRun) -> None:
        if run.chunks == 2:
            raise Killed

    with pytest.raises(Killed):
        run_chunked(inputs(), stage(), out, chunk_rows=6, on_chunk=kill_after_two)
    kept = lance.dataset(out.table.uri).to_table().column("id").to_pylist()
    assert len(kept) == 12  # two chunks of six committed, the rest lost with the run

    seen: list[int] = []
    rest = pending_rows(inputs(), out.table)
    assert sorted(rest.to_pandas()["id"]) == sorted(set(IDS) - set(kept))
    run = run_chunked(rest, stage(), out, chunk_rows=3,
                      on_chunk=lambda chunk, r: seen.append(r.committed))
    assert (run.rows, run.committed, run.chunks, run.commits) == (8, 8, 3, 3)
    assert seen == [3, 6, 8]  # the callback sees the run grow chunk by chunk
    table = lance.dataset(out.table.uri)
    assert sorted(table.to_table().column("id").to_pylist()) == IDS
    assert table.to_table(filter="id = 's:007'").column("value").to_pylist() == [49]
    # More than one commit: compacted into one fragment, the run's last version reported.
    assert run.compacted_from == 5 and len(table.get_fragments()) == 1  # a fragment a commit
    assert run.lance_version == table.version
    for version_ids in ids_at_every_version(out.table.uri):
        assert len(version_ids) == len(set(version_ids))  # never a doubled id


def test_rows_left_out_of_a_commit_are_pending_again_and_replace_not_double(
        ray_session, tmp_path):
    out = target(tmp_path)
    ok_only = lambda chunk: chunk.filter(chunk.column("ok"))  # noqa: E731
    first = run_chunked(inputs(), stage(fail=frozenset({"s:004", "s:011"})), out,
                        chunk_rows=8, to_commit=ok_only)
    assert (first.rows, first.committed, first.chunks) == (20, 18, 3)
    assert pending_rows(inputs(), out.table).to_pandas()["id"].tolist() == ["s:004", "s:011"]

    # Committing rows again under the same key replaces them.
    again = run_chunked(inputs(IDS[:5]), stage(), out, chunk_rows=8)
    assert (again.committed, again.commits, again.compacted_from) == (5, 1, None)
    rows = lance.dataset(out.table.uri).to_table()
    assert Counter(rows.column("id").to_pylist()) == Counter(set(IDS) - {"s:011"})
    assert pc.all(rows.column("ok")).as_py()


def test_nothing_pending_builds_no_stage(tmp_path):
    def must_not_run(rows):
        raise AssertionError("the stage was built with nothing to do")

    out = target(tmp_path)
    assert run_chunked(None, must_not_run, out, chunk_rows=10) == ChunkedRun()
    lance.write_dataset(SCHEMA.empty_table(), out.table.uri, schema=SCHEMA)
    assert run_chunked(None, must_not_run, out, chunk_rows=10).lance_version == 1
    with pytest.raises(ValueError, match="chunk_rows"):
        run_chunked(None, must_not_run, out, chunk_rows=0)


@pytest.mark.parametrize("broadcast_limit", [1_000_000, 0])  # 0: the Ray hash-join path
def test_done_rows_are_selected_out_by_broadcast_or_join(ray_session, tmp_path,
                                                         broadcast_limit):
    out = target(tmp_path)
    lance.write_dataset(square(pa.table({"id": IDS[:15]}), fail=frozenset(IDS[:5])),
                        out.table.uri, schema=SCHEMA)
    # Only rows matching the done filter count as done: the failed five are pending again.
    pending = pending_rows(inputs(), out.table, "ok = true", broadcast_limit)
    assert sorted(pending.to_pandas()["id"]) == IDS[:5] + IDS[15:]
    done = ray.data.from_arrow(pa.table({"id": IDS[:10]}))
    assert sorted(without_ids(inputs(), done, 10, broadcast_limit).to_pandas()["id"]) == IDS[10:]
    assert drop_ids(inputs(), pa.array([], pa.string())).count() == 20


def test_a_stage_report_reads_the_runner_counts_through():
    from dataclasses import dataclass

    @dataclass
    class StageReport(ChunkedReport):
        version: str

    report = StageReport("v1")
    assert (report.written, report.chunks, report.lance_version) == (0, 0, None)
    report.commits = ChunkedRun(chunks=2, commits=2, rows=9, committed=7, seconds=1.5,
                                lance_version=4)
    assert (report.written, report.chunks, report.seconds, report.lance_version) == \
        (7, 2, 1.5, 4)


def test_a_small_hash_join_starts_one_partition_and_a_big_one_500k_rows_each():
    assert [hash_partitions(n) for n in (0, 10, 999_999, 10**6, 10**8, 10**12)] == \
        [1, 1, 1, 2, 200, 512]
