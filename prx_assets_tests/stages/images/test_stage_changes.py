"""The image stage handed only what changed in raw_images since bucketed's record
(`storage.changes`): new, changed and removed raw rows, a raw compaction (ids compared in
full only when bucketed ends with more rows than raw), other settings, a run that fails
before its record, a replaced table."""

import hashlib

import lance
import pyarrow as pa
import pytest
import ray.data

from prx_assets.stages.images import stage as image_stage
from prx_assets.stages.images.imaging import ImageOptions
from prx_assets.stages.images.stage import (
    BUCKETED_SCHEMA,
    UPSTREAM,
    ImageTables,
    ensure_table,
    run_image_stage,
    settings_fingerprint,
)
from prx_assets.storage.changes import read_consumed
from prx_assets.storage.refs import TableRef
from prx_assets.testing.images import jpeg_bytes

RAW_SCHEMA = pa.schema([("id", pa.string()), ("source", pa.string()), ("status", pa.string()),
                        ("image", pa.large_binary()), ("error", pa.string()),
                        ("width", pa.int32()), ("height", pa.int32()), ("sha256", pa.string())])
OPTIONS = ImageOptions()


def raw_rows(ids: list[str], seed: int = 0) -> pa.Table:
    rows = []
    for n, i in enumerate(ids):
        data = jpeg_bytes(420 + 8 * n, 400, seed=seed + n)
        rows.append({"id": i, "source": "s", "status": "ok", "image": data, "error": None,
                     "width": 420 + 8 * n, "height": 400,
                     "sha256": hashlib.sha256(data).hexdigest()})
    return pa.Table.from_pylist(rows, schema=RAW_SCHEMA)


def unreadable(raw: TableRef) -> ray.data.Dataset:
    """The whole raw table as the IO manager hands it, failing if a run reads it."""
    def refuse(batch):
        raise AssertionError("the run read every raw row")
    return raw.read().map_batches(refuse, batch_format="pyarrow")


@pytest.fixture()
def tables(tmp_path):
    return ImageTables(TableRef.of(tmp_path / "bucketed.lance"),
                       TableRef.of(tmp_path / "phashes.lance"))


def run(raw_uri: str, tables: ImageTables, raw=None, options=OPTIONS, **kwargs):
    pinned = TableRef.of(raw_uri).pinned()
    return run_image_stage(raw if raw is not None else pinned.read(), pinned, tables,
                           options, chunk_rows=2, **kwargs)


def held(tables: ImageTables) -> dict[str, str]:
    rows = tables.bucketed.latest().to_table(columns=["id", "raw_sha256"]).to_pylist()
    assert len(rows) == len({r["id"] for r in rows})  # each id once
    return {r["id"]: r["raw_sha256"] for r in rows}


def raw_held(raw_uri: str) -> dict[str, str]:
    return {r["id"]: r["sha256"] for r in
            lance.dataset(raw_uri).to_table(columns=["id", "sha256"]).to_pylist()}


def no_full_comparison(monkeypatch):
    def refuse(*_args, **_kwargs):
        raise AssertionError("removals were compared in full")
    monkeypatch.setattr(image_stage, "removed_ids", refuse)


def test_a_run_is_handed_only_what_changed(ray_session, tmp_path, tables, monkeypatch):
    raw_uri = str(tmp_path / "raw.lance")
    lance.write_dataset(raw_rows(["a", "b", "c", "d"]), raw_uri)
    assert run(raw_uri, tables).written == 4
    assert read_consumed(tables.bucketed, UPSTREAM, settings_fingerprint(OPTIONS)) is not None

    raw = lance.write_dataset(raw_rows(["e"], seed=10), raw_uri, mode="append")
    raw.delete("id = 'b'")
    raw.merge_insert("id").when_matched_update_all().when_not_matched_insert_all() \
        .execute(raw_rows(["c"], seed=20))  # new bytes for c
    no_full_comparison(monkeypatch)
    report = run(raw_uri, tables, raw=unreadable(TableRef.of(raw_uri).pinned()))
    assert (report.written, report.removed) == (2, 1)  # e and c; b
    assert held(tables) == raw_held(raw_uri)
    phash_ids = tables.phashes.latest().to_table(columns=["id"]).column("id").to_pylist()
    assert sorted(phash_ids) == ["a", "c", "d", "e"]

    # Nothing changed: nothing read, nothing written, the version stays.
    version = tables.bucketed.latest_version()
    report = run(raw_uri, tables, raw=unreadable(TableRef.of(raw_uri).pinned()))
    assert (report.written, report.removed) == (0, 0)
    assert tables.bucketed.latest_version() == version


def test_after_a_raw_compaction_removals_are_compared_in_full(ray_session, tmp_path, tables):
    raw_uri = str(tmp_path / "raw.lance")
    lance.write_dataset(raw_rows(["a", "b"]), raw_uri)
    lance.write_dataset(raw_rows(["c"], seed=5), raw_uri, mode="append")
    run(raw_uri, tables)
    raw = lance.dataset(raw_uri)
    raw.delete("id = 'a'")
    raw.optimize.compact_files()  # b and c move to a new fragment
    report = run(raw_uri, tables, raw=unreadable(TableRef.of(raw_uri).pinned()))
    assert (report.written, report.removed) == (0, 1)  # moved rows are found done
    assert held(tables) == raw_held(raw_uri)


def test_a_raw_compaction_that_removed_nothing_compares_nothing(ray_session, tmp_path, tables,
                                                               monkeypatch):
    raw_uri = str(tmp_path / "raw.lance")
    lance.write_dataset(raw_rows(["a", "b"]), raw_uri)
    lance.write_dataset(raw_rows(["c"], seed=5), raw_uri, mode="append")
    run(raw_uri, tables)
    lance.write_dataset(raw_rows(["d"], seed=7), raw_uri, mode="append")
    lance.dataset(raw_uri).optimize.compact_files()  # every row moves, d is new
    no_full_comparison(monkeypatch)
    report = run(raw_uri, tables, raw=unreadable(TableRef.of(raw_uri).pinned()))
    assert (report.written, report.removed) == (1, 0)
    assert held(tables) == raw_held(raw_uri)


def test_other_settings_consume_in_full(ray_session, tmp_path, tables):
    raw_uri = str(tmp_path / "raw.lance")
    lance.write_dataset(raw_rows(["a", "b"]), raw_uri)
    run(raw_uri, tables)
    other = ImageOptions(quality=80)
    assert read_consumed(tables.bucketed, UPSTREAM, settings_fingerprint(other)) is None
    assert run(raw_uri, tables, options=other).written == 2
    assert read_consumed(tables.bucketed, UPSTREAM, settings_fingerprint(other)) is not None


def test_a_failed_run_leaves_the_record_it_found(ray_session, tmp_path, tables):
    raw_uri = str(tmp_path / "raw.lance")
    lance.write_dataset(raw_rows(["a"]), raw_uri)
    run(raw_uri, tables)
    before = read_consumed(tables.bucketed, UPSTREAM, settings_fingerprint(OPTIONS))
    lance.write_dataset(raw_rows(["b", "c", "d", "e"], seed=3), raw_uri, mode="append")

    def fail_after_first_chunk(_report):
        raise RuntimeError("killed after a chunk")
    with pytest.raises(RuntimeError, match="killed"):
        run(raw_uri, tables, on_chunk=fail_after_first_chunk)
    assert read_consumed(tables.bucketed, UPSTREAM, settings_fingerprint(OPTIONS)) == before
    assert len(held(tables)) == 3  # a and the chunk committed (2 rows)
    report = run(raw_uri, tables, raw=unreadable(TableRef.of(raw_uri).pinned()))
    assert report.written == 2  # the chunk committed is found done
    assert held(tables) == raw_held(raw_uri)


def test_a_replaced_table_forgets_its_record(ray_session, tmp_path, tables):
    raw_uri = str(tmp_path / "raw.lance")
    lance.write_dataset(raw_rows(["a", "b"]), raw_uri)
    run(raw_uri, tables)
    assert ensure_table(tables.bucketed, BUCKETED_SCHEMA, replace=True)
    assert read_consumed(tables.bucketed, UPSTREAM, settings_fingerprint(OPTIONS)) is None
    assert run(raw_uri, tables).written == 2
