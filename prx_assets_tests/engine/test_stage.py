"""The stage skeleton: what a stage declares, what `run_stage` does with it (the table made,
the upstream pinned and recorded only once every row is final, the report), and the one
`Coverage` shape."""

import lance
import pyarrow as pa
import pyarrow.compute as pc
import pytest
import ray.data

from prx_assets.engine.chunked import pending_rows
from prx_assets.engine.stage import Coverage, Pending, Stage, StageReport, TableSpec, run_stage
from prx_assets.storage.changes import read_consumed
from prx_assets.storage.refs import TableRef

SCHEMA = pa.schema([pa.field("id", pa.string(), nullable=False), ("length", pa.int64())])


class Lengths(Stage[StageReport]):
    """Each upstream text's length, keyed on id; texts named "bad" fail (left out)."""

    table = TableSpec(SCHEMA, ("id",))
    upstream = "texts"
    failpoint = "test.lengths.chunk_committed"

    def report(self) -> StageReport:
        return StageReport()

    def record_tag(self) -> str:
        return "v1"

    def pending(self, upstream, target, report) -> Pending:
        rows = pending_rows(upstream.read(), target)
        return Pending(upstream.count_rows(), rows)

    def transform(self, rows: ray.data.Dataset, count: int) -> ray.data.Dataset:
        def lengths(batch: pa.Table) -> pa.Table:
            ok = pc.not_equal(batch.column("text"), "bad")
            return pa.table({"id": batch.column("id"), "length": pc.if_else(
                ok, pc.utf8_length(batch.column("text")).cast(pa.int64()), None)})
        return rows.map_batches(lengths, batch_format="pyarrow")

    def to_commit(self, chunk: pa.Table) -> pa.Table:
        return chunk.filter(pc.is_valid(chunk.column("length")))

    def count(self, chunk: pa.Table, report: StageReport) -> None:
        report.counts.update("ok" if n is not None else "failed"
                             for n in chunk.column("length").to_pylist())

    def finished(self, report: StageReport) -> bool:
        return report.counts["failed"] == 0


def test_a_run_commits_counts_and_records_only_when_every_row_is_final(ray_session, tmp_path):
    texts = TableRef.of(tmp_path / "texts.lance")
    target = TableRef.of(tmp_path / "lengths.lance")
    lance.write_dataset(pa.table({"id": ["a", "b", "c"], "text": ["x", "bad", "xyz"]}),
                        str(texts))
    report = run_stage(Lengths(), texts, target, chunk_rows=2)
    assert (report.to_do, report.written, report.upstream_version) == (3, 2, 1)
    assert report.counts == {"ok": 2, "failed": 1}
    assert read_consumed(target, "texts", "v1") is None  # "b" is left to retry
    got = dict(zip(*target.latest().to_table().to_pydict().values(), strict=True))
    assert got == {"a": 1, "c": 3}

    lance.dataset(str(texts)).merge_insert("id").when_matched_update_all().execute(
        pa.table({"id": ["b"], "text": ["fixed"]}))
    again = run_stage(Lengths(), texts, target, chunk_rows=2)
    assert (again.written, again.upstream_version) == (1, 2)
    assert read_consumed(target, "texts", "v1") is not None


def test_a_missing_upstream_is_a_clear_error_and_the_table_exists_anyway(tmp_path):
    target = TableRef.of(tmp_path / "lengths.lance")
    with pytest.raises(FileNotFoundError, match="materialise texts first"):
        run_stage(Lengths(), TableRef.of(tmp_path / "none.lance"), target, chunk_rows=2)
    assert target.latest().open().schema == SCHEMA


def test_coverage_counts_rows_by_value_and_shares_of_the_inputs():
    cover = Coverage(inputs=4, counts={"ok": 2, "failed": 1})
    assert (cover.rows(), cover.rows("ok"), cover.rows("ok", "absent")) == (3, 2, 2)
    assert (cover.share(), cover.share(cover.rows("ok"))) == (0.75, 0.5)
    assert Coverage(inputs=0, counts={}).share() == 1.0
