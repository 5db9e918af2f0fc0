"""Incremental ingest: a rerun reads only the units that changed, deletes the rows that
left, resumes a cut-off unit, and ends with the table a full rebuild would write."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from pathlib import Path

import lance
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prx_assets.engine.chunked import CommitTarget
from prx_assets.stages.ingest import listing, readers
from prx_assets.stages.ingest.ingest import (
    IngestOptions,
    IngestReport,
    ingest_source,
)
from prx_assets.stages.ingest.raw_rows import RAW_IMAGES_SCHEMA
from prx_assets.stages.ingest.removals import RemovalLimitError
from prx_assets.stages.ingest.sources import SourceSpec
from prx_assets.storage.lance_tables import FragmentPolicy
from prx_assets.storage.refs import TableRef
from prx_assets.testing.images import jpeg_bytes

N = 5


def target(path: Path) -> CommitTarget:
    return CommitTarget(TableRef.of(path), RAW_IMAGES_SCHEMA, ["id"],
                        FragmentPolicy(target_bytes=512 << 20))


def ingest(spec: SourceSpec, table: Path, **options) -> IngestReport:
    return ingest_source(spec, spec.uri, target(table), IngestOptions(**options))


def rows(table: Path) -> list[dict]:
    return sorted(lance.dataset(str(table)).to_table().to_pylist(), key=lambda r: r["id"])


def assert_equals_full_rebuild(spec: SourceSpec, table: Path, tmp_path: Path) -> None:
    fresh = tmp_path / f"fresh-{len(list(tmp_path.iterdir()))}.lance"
    ingest(spec, fresh)
    assert rows(table) == rows(fresh)
    ids = [r["id"] for r in rows(table)]
    assert len(ids) == len(set(ids))


def add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_tar(path: Path, samples: dict[str, bytes]) -> None:
    with tarfile.open(path, "w") as tar:
        for key, data in samples.items():
            add_member(tar, f"{key}.jpg", data)
            add_member(tar, f"{key}.txt", f"caption of {key}".encode())


def write_parquet(path: Path, keys: list[str], seed: int) -> None:
    pq.write_table(pa.table({"k": keys, "img": [jpeg_bytes(400, 300, seed + i)
                                                for i in range(len(keys))]}), path)


def folder_source(root: Path) -> SourceSpec:
    root.mkdir()
    for i in range(N):
        (root / f"{i:02d}.jpg").write_bytes(jpeg_bytes(400, 300, i))
    return SourceSpec(name="web", kind="image_folder", uri=str(root))


def tar_source(root: Path) -> SourceSpec:
    root.mkdir()
    for i in range(N):
        write_tar(root / f"shard-{i}.tar", {f"{i:03d}": jpeg_bytes(400, 300, i)})
    return SourceSpec(name="tars", kind="webdataset", uri=str(root))


def parquet_source(root: Path) -> SourceSpec:
    root.mkdir()
    for i in range(N):
        write_parquet(root / f"part-{i}.parquet", [f"key-{i}"], seed=i)
    return SourceSpec(name="pq", kind="parquet", uri=str(root), image_column="img",
                      key_column="k")


def gain_one_lose_one(spec: SourceSpec) -> None:
    root = Path(spec.uri)
    if spec.kind == "image_folder":
        (root / "new.jpg").write_bytes(jpeg_bytes(420, 300, 99))
        (root / "00.jpg").unlink()
    elif spec.kind == "webdataset":
        write_tar(root / "shard-new.tar", {"new": jpeg_bytes(420, 300, 99)})
        (root / "shard-0.tar").unlink()
    else:
        write_parquet(root / "part-new.parquet", ["key-new"], seed=99)
        (root / "part-0.parquet").unlink()


@pytest.mark.parametrize("make", [folder_source, tar_source, parquet_source],
                         ids=["image_folder", "webdataset", "parquet"])
def test_gaining_one_file_and_losing_one_redoes_exactly_those_rows(ray_session, tmp_path, make):
    spec = make(tmp_path / "source")
    table = tmp_path / "raw.lance"
    first = ingest(spec, table)
    assert (first.rows_processed, first.rows_reused, first.rows_removed) == (N, 0, 0)
    assert first.rows == N and first.changed

    unchanged = ingest(spec, table)
    assert (unchanged.rows_processed, unchanged.rows_reused, unchanged.rows_removed) == (0, N, 0)
    assert unchanged.lance_version == first.lance_version and not unchanged.changed
    assert unchanged.units_read == 0 and unchanged.commits.commits == 0

    before = {r["source_key"]: r for r in rows(table)}
    gain_one_lose_one(spec)
    rerun = ingest(spec, table)
    assert (rerun.rows_processed, rerun.rows_reused, rerun.rows_removed) == (1, N - 1, 1)
    assert rerun.units_read == 1 and rerun.changed and rerun.rows == N
    after = {r["source_key"]: r for r in rows(table)}
    kept = set(before) & set(after)
    assert len(kept) == N - 1 and all(after[k] == before[k] for k in kept)
    assert_equals_full_rebuild(spec, table, tmp_path)


def test_a_listing_that_fails_part_way_removes_no_row(ray_session, tmp_path, monkeypatch):
    """A sub-folder that cannot be listed on the rerun (a mount gone, permissions): the run
    fails naming it, and every row, those of its files included, stays."""
    spec = folder_source(tmp_path / "source")
    nested = Path(spec.uri) / "nested"
    nested.mkdir()
    for i in range(2):
        (nested / f"n{i}.jpg").write_bytes(jpeg_bytes(400, 300, 50 + i))
    table = tmp_path / "raw.lance"
    assert ingest(spec, table).rows == N + 2
    before = rows(table)
    version = lance.dataset(str(table)).version

    scandir = readers.os.scandir

    def refusing(path):
        if not isinstance(path, int) and Path(path) == nested:
            raise PermissionError(13, "Permission denied", str(path))
        return scandir(path)

    monkeypatch.setattr(readers.os, "scandir", refusing)
    (Path(spec.uri) / "added.jpg").write_bytes(jpeg_bytes(420, 300, 77))
    with pytest.raises(listing.ListingError, match=rf"{nested}.*Permission denied"):
        ingest(spec, table, max_removed_share=1.0)
    assert rows(table) == before and lance.dataset(str(table)).version == version


def test_a_run_removing_more_than_its_share_stops_and_removes_nothing(ray_session, tmp_path):
    spec = folder_source(tmp_path / "source")
    table = tmp_path / "raw.lance"
    ingest(spec, table)
    for i in range(2):  # 2 of 5 rows: 40 %
        (Path(spec.uri) / f"{i:02d}.jpg").unlink()
    with pytest.raises(RemovalLimitError, match=r"remove 2 of 5 rows \(40%\).*allowed 10%"):
        ingest(spec, table, removal_floor_rows=0)
    assert len(rows(table)) == N
    allowed = ingest(spec, table, removal_floor_rows=0, max_removed_share=0.5)
    assert allowed.rows_removed == 2 and allowed.rows == N - 2


def test_a_rewritten_file_gets_its_new_bytes_and_sha256(ray_session, tmp_path):
    spec = folder_source(tmp_path / "source")
    table = tmp_path / "raw.lance"
    ingest(spec, table)
    path = Path(spec.uri) / "01.jpg"
    new = jpeg_bytes(640, 480, 1234)
    path.write_bytes(new)
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # a later mtime
    report = ingest(spec, table)
    assert (report.rows_processed, report.rows_reused, report.rows_removed) == (1, N - 1, 0)
    row = next(r for r in rows(table) if r["source_key"] == "01.jpg")
    assert row["image"] == new and row["sha256"] == hashlib.sha256(new).hexdigest()
    assert (row["width"], row["height"]) == (640, 480)
    # A new caption file alone changes the image's signature too.
    (Path(spec.uri) / "02.txt").write_text("a caption added later")
    report = ingest(spec, table)
    assert report.rows_processed == 1
    assert next(r for r in rows(table) if r["source_key"] == "02.jpg")["original_caption"] == \
        "a caption added later"
    assert_equals_full_rebuild(spec, table, tmp_path)


def test_a_changed_tar_is_reread_and_its_removed_members_leave(ray_session, tmp_path):
    root = tmp_path / "source"
    root.mkdir()
    write_tar(root / "a.tar", {k: jpeg_bytes(400, 300, i) for i, k in enumerate("pqrs")})
    write_tar(root / "b.tar", {"t": jpeg_bytes(400, 300, 9)})
    spec = SourceSpec(name="tars", kind="webdataset", uri=str(root))
    table = tmp_path / "raw.lance"
    ingest(spec, table)
    # a.tar loses member q, gains member u, and member r gets new bytes.
    new_r = jpeg_bytes(500, 300, 77)
    write_tar(root / "a.tar", {"p": jpeg_bytes(400, 300, 0), "r": new_r,
                               "s": jpeg_bytes(400, 300, 3), "u": jpeg_bytes(400, 300, 8)})
    stat = (root / "a.tar").stat()
    os.utime(root / "a.tar", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    report = ingest(spec, table)
    assert (report.rows_processed, report.rows_reused, report.rows_removed) == (4, 1, 1)
    by_key = {r["source_key"]: r for r in rows(table)}
    assert set(by_key) == {"a.tar/p", "a.tar/r", "a.tar/s", "a.tar/u", "b.tar/t"}
    assert by_key["a.tar/r"]["sha256"] == hashlib.sha256(new_r).hexdigest()
    assert_equals_full_rebuild(spec, table, tmp_path)


def test_a_unit_cut_off_between_chunks_is_read_again_whole(ray_session, tmp_path):
    """A tar whose first rows were committed when the run stopped: its rows carry the
    signature but not all are there, so the rerun reads it again (merge-insert replaces)."""
    root = tmp_path / "source"
    root.mkdir()
    write_tar(root / "a.tar", {f"{i:02d}": jpeg_bytes(400, 300, i) for i in range(6)})
    spec = SourceSpec(name="tars", kind="webdataset", uri=str(root))
    table = tmp_path / "raw.lance"

    class Stop(Exception):
        pass

    def stop_after_first(chunk, run):
        raise Stop

    with pytest.raises(Stop):
        ingest_source(spec, spec.uri, target(table), IngestOptions(chunk_rows=2),
                      on_chunk=stop_after_first)
    assert lance.dataset(str(table)).count_rows() == 2  # one chunk committed
    report = ingest(spec, table, chunk_rows=2)
    assert report.units_read == 1 and report.rows_processed == 6 and report.rows == 6
    assert_equals_full_rebuild(spec, table, tmp_path)


def test_a_lance_source_is_read_again_only_when_its_version_changes(ray_session, tmp_path):
    src = tmp_path / "src.lance"
    lance.write_dataset(pa.table({"key": ["k1", "k2"], "image": [jpeg_bytes(400, 300, 1),
                                                                 jpeg_bytes(400, 300, 2)]}), src)
    spec = SourceSpec(name="ln", kind="lance", uri=str(src), key_column="key")
    table = tmp_path / "raw.lance"
    assert ingest(spec, table).rows_processed == 2
    unchanged = ingest(spec, table)
    assert unchanged.rows_processed == 0 and not unchanged.changed
    lance.dataset(str(src)).delete("key = 'k1'")
    lance.write_dataset(pa.table({"key": ["k3"], "image": [jpeg_bytes(400, 300, 3)]}), src,
                        mode="append")
    report = ingest(spec, table)
    assert report.rows_removed == 1 and report.rows == 2
    assert sorted(r["source_key"] for r in rows(table)) == ["k2", "k3"]
    assert_equals_full_rebuild(spec, table, tmp_path)


def test_a_table_of_the_old_schema_is_rebuilt_once(ray_session, tmp_path):
    spec = folder_source(tmp_path / "source")
    table = tmp_path / "raw.lance"
    old_schema = pa.schema([f for f in RAW_IMAGES_SCHEMA if not f.name.startswith("unit")])
    lance.write_dataset(old_schema.empty_table(), table)
    messages: list[str] = []
    report = ingest_source(spec, spec.uri, target(table), log=messages.append)
    assert report.rebuilt_because and "unit" in report.rebuilt_because
    assert any("rebuilding in full" in m for m in messages)
    assert report.rows == N and report.rows_processed == N
    assert ingest(spec, table).rebuilt_because is None
    assert_equals_full_rebuild(spec, table, tmp_path)


def test_a_big_table_compares_in_ray_hash_joins_with_the_same_result(
        ray_session, tmp_path, monkeypatch):
    """Past DRIVER_COMPARE_ROWS the listing and the table meet in Ray joins: changed,
    removed, added and cut-off units come out as on the driver."""
    from prx_assets.stages.ingest import ingest as ingest_module

    root = tmp_path / "source"
    root.mkdir()
    write_tar(root / "a.tar", {k: jpeg_bytes(400, 300, i) for i, k in enumerate("pqrs")})
    write_tar(root / "b.tar", {"t": jpeg_bytes(400, 300, 9)})
    write_tar(root / "c.tar", {"v": jpeg_bytes(400, 300, 10)})
    spec = SourceSpec(name="tars", kind="webdataset", uri=str(root))
    table = tmp_path / "raw.lance"
    ingest(spec, table)
    monkeypatch.setattr(ingest_module, "DRIVER_COMPARE_ROWS", 0)
    write_tar(root / "a.tar", {"p": jpeg_bytes(400, 300, 0), "r": jpeg_bytes(500, 300, 77),
                               "s": jpeg_bytes(400, 300, 3), "u": jpeg_bytes(400, 300, 8)})
    stat = (root / "a.tar").stat()
    os.utime(root / "a.tar", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    (root / "c.tar").unlink()
    write_tar(root / "d.tar", {"w": jpeg_bytes(400, 300, 11)})

    class Stop(Exception):
        pass

    def stop(chunk, run):
        raise Stop

    with pytest.raises(Stop):
        ingest_source(spec, spec.uri, target(table), IngestOptions(chunk_rows=2), on_chunk=stop)
    report = ingest(spec, table, chunk_rows=2)
    assert report.rows_removed == 2 and report.rows == 6  # a.tar/q and c.tar/v
    assert 0 < report.rows_processed <= 5 and report.units_listed == 3
    unchanged = ingest(spec, table)
    assert unchanged.rows_processed == 0 and not unchanged.changed
    assert unchanged.rows_reused == 6 and unchanged.rows_removed == 0
    monkeypatch.setattr(ingest_module, "DRIVER_COMPARE_ROWS", 1_000_000)
    assert_equals_full_rebuild(spec, table, tmp_path)


def test_a_key_repeated_in_a_source_is_one_row(ray_session, tmp_path):
    """A tar whose sample members are not adjacent yields its key twice: its first item is
    the row."""
    root = tmp_path / "source"
    root.mkdir()
    img = jpeg_bytes(400, 300, 1)
    with tarfile.open(root / "a.tar", "w") as tar:
        for name, data in (("x.jpg", img), ("y.jpg", img), ("x.txt", b"late caption")):
            add_member(tar, name, data)
    spec = SourceSpec(name="tars", kind="webdataset", uri=str(root))
    table = tmp_path / "raw.lance"
    first = ingest(spec, table)
    assert first.rows == 2 and first.rows_processed == 2
    assert sorted(r["source_key"] for r in rows(table)) == ["a.tar/x", "a.tar/y"]
    assert ingest(spec, table).rows_processed == 0  # complete: nothing read again


def test_a_key_in_two_units_is_a_duplicate_key_row_naming_both(ray_session, tmp_path):
    """Before: the unit read later won silently (one row, no word about the other)."""
    root = tmp_path / "source"
    root.mkdir()
    for name, shade in (("a.parquet", 1), ("b.parquet", 2)):
        pq.write_table(pa.table({"k": ["x"], "image": [jpeg_bytes(400, 300, shade)]}),
                       root / name)
    spec = SourceSpec(name="pq", kind="parquet", uri=str(root), key_column="k")
    table = tmp_path / "raw.lance"
    assert ingest(spec, table).rows == 2
    got = {r["source_key"]: r for r in rows(table)}
    assert got["x"]["status"] == "ok" and got["x"]["unit"] == "a.parquet"
    duplicate = got["b.parquet#x"]
    assert duplicate["status"] == "duplicate_key" and duplicate["image"] is None
    assert "'a.parquet'" in duplicate["error"] and "'b.parquet'" in duplicate["error"]
    assert ingest(spec, table).rows_processed == 0  # each unit counts as read whole


def _parquet_units(root: Path, units: dict[str, int]) -> SourceSpec:
    """Parquet files each holding the key `x` (`units`: file name -> image shade)."""
    root.mkdir(exist_ok=True)
    for name, shade in units.items():
        pq.write_table(pa.table({"k": ["x"], "image": [jpeg_bytes(400, 300, shade)]}),
                       root / name)
    return SourceSpec(name="pq", kind="parquet", uri=str(root), key_column="k")


def _assert_kept_by(table: Path, kept: str, duplicate: str) -> None:
    got = {r["source_key"]: r for r in rows(table)}
    assert sorted(got) == sorted(["x", f"{duplicate}#x"])
    assert got["x"]["status"] == "ok" and got["x"]["unit"] == kept
    row = got[f"{duplicate}#x"]
    assert row["status"] == "duplicate_key" and row["image"] is None
    assert f"'{kept}'" in row["error"] and f"'{duplicate}'" in row["error"]


def test_a_key_in_two_units_of_different_chunks_is_a_duplicate_key_row(ray_session, tmp_path):
    """One row a chunk: the units are never in one chunk. Before, the chunk committed later
    replaced the other unit's row silently (one row, no duplicate_key)."""
    spec = _parquet_units(tmp_path / "source", {"a.parquet": 1, "b.parquet": 2})
    table = tmp_path / "raw.lance"
    assert ingest(spec, table, chunk_rows=1).rows == 2
    _assert_kept_by(table, "a.parquet", "b.parquet")
    assert ingest(spec, table, chunk_rows=1).rows_processed == 0  # both read whole


def test_a_unit_added_later_with_a_committed_key_is_compared_with_it(ray_session, tmp_path):
    """A unit arriving in a later run: first by name, it takes the key and the committed
    row becomes its unit's duplicate_key row; later by name, its own row is the duplicate."""
    root = tmp_path / "source"
    table = tmp_path / "raw.lance"
    ingest(_parquet_units(root, {"b.parquet": 2}), table)
    assert ingest(_parquet_units(root, {"a.parquet": 1}), table).rows == 2
    _assert_kept_by(table, "a.parquet", "b.parquet")
    assert ingest(_parquet_units(root, {"c.parquet": 3}), table).rows == 3
    got = {r["source_key"]: r for r in rows(table)}
    assert got["x"]["unit"] == "a.parquet" and got["c.parquet#x"]["status"] == "duplicate_key"
    assert ingest(_parquet_units(root, {}), table).rows_processed == 0


def test_new_files_are_appended_and_a_rewritten_one_merged(ray_session, tmp_path):
    """A chunk none of whose ids is committed is appended (no merge looks them up again);
    a chunk holding a committed id merges, so that id stays one row."""
    spec = folder_source(tmp_path / "source")
    table = tmp_path / "raw.lance"
    first = ingest(spec, table, chunk_rows=2)
    # The first chunk creates the table; the two after it are appended.
    assert (first.commits.commits, first.commits.appended) == (3, N - 2)
    (Path(spec.uri) / "01.jpg").write_bytes(jpeg_bytes(420, 300, 77))
    rerun = ingest(spec, table, chunk_rows=2)
    assert (rerun.units_read, rerun.commits.commits, rerun.commits.appended) == (1, 1, 0)
    assert_equals_full_rebuild(spec, table, tmp_path)
