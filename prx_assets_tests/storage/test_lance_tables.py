from pathlib import Path

import lance
import numpy as np
import pyarrow as pa
import pytest
import ray.data

from prx_assets.storage.lance_tables import (
    FragmentPolicy,
    add_missing_columns,
    adopt_encodings,
    compact,
    write_dataset_atomically,
)
from prx_assets.storage.layout import Storage
from prx_assets.storage.refs import TableRef
from prx_assets.storage.table_checks import duplicate_ids, fragment_health

SCHEMA = pa.schema([("id", pa.string()), ("blob", pa.large_binary())])


def blob_rows(n: int, size: int = 10_000, start: int = 0) -> ray.data.Dataset:
    def make(batch):
        ids = [f"s:{i}" for i in batch["id"]]
        rng = np.random.default_rng(len(ids))
        blobs = [rng.bytes(size) for _ in ids]  # incompressible, like JPEG bytes
        return pa.table({"id": ids, "blob": blobs}, schema=SCHEMA)

    return ray.data.range(n, override_num_blocks=8).map_batches(
        lambda b: make({"id": [i + start for i in b["id"]]}), batch_format="numpy")


def test_layout_follows_the_design(tmp_path: Path):
    assert (Storage(tmp_path).table("raw_images", "web").uri
            == str(tmp_path / "lance/raw_images/web.lance"))
    assert Storage(tmp_path).table("duplicates").uri == str(tmp_path / "lance/duplicates.lance")


def test_write_commits_once_and_compacts_by_bytes(ray_session, tmp_path: Path):
    uri = TableRef.of(tmp_path / "t.lance")
    policy = FragmentPolicy(target_bytes=300_000)  # ~30 rows of 10 kB per fragment
    report = write_dataset_atomically(blob_rows(200), uri, policy, SCHEMA)
    assert report.rows == 200
    assert report.bytes >= 2_000_000  # incompressible blobs: the byte target is meaningful
    assert 2 <= report.fragments <= 9  # split by bytes, not one per Ray block
    health = fragment_health(uri, policy)
    assert health.healthy, health
    assert duplicate_ids(uri) == (0, [])


def test_compaction_merges_small_fragments_toward_the_byte_target(tmp_path: Path):
    uri = TableRef.of(tmp_path / "t.lance")
    rng = np.random.default_rng(0)
    table = pa.table({"id": [str(i) for i in range(100)],
                      "blob": [rng.bytes(10_000) for _ in range(100)]}, schema=SCHEMA)
    lance.write_dataset(table, uri.uri, max_rows_per_file=5)  # 20 tiny fragments
    before = compact(uri, FragmentPolicy(target_bytes=500_000))
    after = lance.dataset(str(uri))
    assert before == 20 and len(after.get_fragments()) <= 3 and after.count_rows() == 100


def test_rewrite_replaces_the_whole_table_and_keeps_the_old_version(ray_session, tmp_path: Path):
    uri = TableRef.of(tmp_path / "t.lance")
    first = write_dataset_atomically(blob_rows(50), uri, FragmentPolicy(), SCHEMA)
    second = write_dataset_atomically(blob_rows(30, start=100), uri, FragmentPolicy(), SCHEMA)
    assert second.version > first.version and second.rows == 30
    assert lance.dataset(str(uri)).count_rows() == 30  # no duplicates, no leftovers
    assert lance.dataset(str(uri), version=first.version).count_rows() == 50


def test_a_rewrite_may_change_the_schema_and_the_old_version_keeps_its_own(ray_session,
                                                                           tmp_path: Path):
    uri = TableRef.of(tmp_path / "t.lance")
    first = write_dataset_atomically(blob_rows(20), uri, FragmentPolicy(), SCHEMA)
    wider = SCHEMA.append(pa.field("made_from", pa.string()))
    rows = blob_rows(10, start=100).map_batches(
        lambda b: {**b, "made_from": np.array(["x"] * len(b["id"]))}, batch_format="numpy")
    second = write_dataset_atomically(rows, uri, FragmentPolicy(), wider)
    table = lance.dataset(str(uri))
    assert table.schema == wider and second.rows == 10
    assert table.to_table(columns=["made_from"]).column(0).to_pylist() == ["x"] * 10
    old = lance.dataset(str(uri), version=first.version)
    assert old.schema == SCHEMA and old.count_rows() == 20


def test_failed_write_leaves_the_previous_version_readable(ray_session, tmp_path: Path):
    uri = TableRef.of(tmp_path / "t.lance")
    good = write_dataset_atomically(blob_rows(40), uri, FragmentPolicy(), SCHEMA)

    def explode(batch):
        if 7 in batch["id"]:
            raise RuntimeError("worker died mid-write")
        return batch

    failing = ray.data.range(20, override_num_blocks=4).map_batches(explode).map_batches(
        lambda b: pa.table({"id": [str(i) for i in b["id"]], "blob": [b"y"] * len(b["id"])},
                           schema=SCHEMA), batch_format="numpy")
    with pytest.raises(Exception, match="worker died"):
        write_dataset_atomically(failing, uri, FragmentPolicy(), SCHEMA)
    table = lance.dataset(str(uri))
    assert table.version == good.version and table.count_rows() == 40


def test_empty_dataset_writes_an_empty_table_with_the_schema(ray_session, tmp_path: Path):
    uri = TableRef.of(tmp_path / "t.lance")
    empty = blob_rows(10).filter(lambda row: False)
    report = write_dataset_atomically(empty, uri, FragmentPolicy(), SCHEMA)
    assert report.rows == 0 and lance.dataset(str(uri)).schema == SCHEMA


@pytest.mark.parametrize("driver_max_rows", [1000, 0], ids=["streamed", "ray-shuffle"])
def test_duplicate_ids_are_found(ray_session, tmp_path: Path, driver_max_rows: int):
    uri = TableRef.of(tmp_path / "t.lance")
    ds = blob_rows(20).union(blob_rows(5))
    write_dataset_atomically(ds, uri, FragmentPolicy(), SCHEMA)
    count, examples = duplicate_ids(uri, limit=3, driver_max_rows=driver_max_rows)
    assert count == 5 and len(examples) == 3 and set(examples) <= {f"s:{i}" for i in range(5)}


def test_a_file_in_the_way_of_an_output_folder_is_named(tmp_path):
    from prx_assets.storage.lance_tables import OutputPathError, prepare_output_dir

    (tmp_path / "lance").write_text("not a folder")
    with pytest.raises(OutputPathError, match=f"{tmp_path / 'lance'} is a file, not a folder"):
        prepare_output_dir(TableRef.of(tmp_path / "lance" / "raw_images" / "web.lance"),
                           "Lance table")
    (tmp_path / "t.lance").write_text("")
    with pytest.raises(OutputPathError, match=r"t\.lance is a file, not a folder"):
        prepare_output_dir(TableRef.of(tmp_path / "t.lance"), "Lance table")
    prepare_output_dir(TableRef.of(tmp_path / "ok" / "x.lance"), "Lance table")
    assert (tmp_path / "ok").is_dir() and not (tmp_path / "ok" / "x.lance").exists()


def test_a_table_made_before_a_nullable_column_gets_it_and_takes_merges_with_it(tmp_path):
    """A stage whose schema grew a nullable column (attributes' `withheld`) writes to a table
    made before it: `TableSpec.ensure` adds the column, all null, without rewriting data."""
    from prx_assets.engine.stage import TableSpec

    ref = TableRef.of(tmp_path / "t.lance")
    old = pa.schema([pa.field("id", pa.string(), nullable=False), pa.field("x", pa.int64())])
    lance.write_dataset(pa.table({"id": ["a"], "x": [1]}, schema=old), ref.uri)
    new = old.append(pa.field("why", pa.string()))
    data_files = sorted(p.name for p in (tmp_path / "t.lance" / "data").iterdir())
    TableSpec(new, ("id",)).ensure(ref)
    assert ref.open().schema.names == ["id", "x", "why"]
    assert sorted(p.name for p in (tmp_path / "t.lance" / "data").iterdir()) == data_files
    ref.open().merge_insert("id").when_matched_update_all().when_not_matched_insert_all() \
        .execute(pa.table({"id": ["b"], "x": [2], "why": ["r"]}, schema=new))
    assert ref.open().to_table().sort_by("id").column("why").to_pylist() == [None, "r"]
    assert add_missing_columns(ref, new) == []  # once only
    with pytest.raises(ValueError, match="non-null"):
        add_missing_columns(ref, new.append(pa.field("must", pa.int8(), nullable=False)))


def test_a_table_made_before_an_encoding_hint_writes_new_rows_with_it(tmp_path):
    """Lance encodes by the table's field metadata, not the written rows': rows of an
    uncompressed image column appended to a table made before the hint came out compressed.
    After `adopt_encodings`, they are stored as they are; a second call changes nothing."""
    from prx_assets.storage.tables import image_bytes_field

    table = TableRef.of(tmp_path / "raw.lance")
    hinted = pa.schema([pa.field("id", pa.string()), image_bytes_field()])
    rng = np.random.default_rng(0)

    def rows(start: int) -> pa.Table:  # bytes a general-purpose compressor shrinks ~3x
        return pa.table({"id": [str(i) for i in range(start, start + 10)],
                         "image": [rng.integers(0, 4, 50_000, dtype=np.uint8).tobytes()
                                   for _ in range(10)]}, schema=hinted)

    def newest_fragment_bytes() -> int:
        fragment = table.open().get_fragments()[-1]
        return sum((tmp_path / "raw.lance" / "data" / f.path).stat().st_size
                   for f in fragment.data_files())

    lance.write_dataset(rows(0).cast(pa.schema([pa.field("id", pa.string()),
                                                pa.field("image", pa.large_binary())])),
                        table.uri)  # the table as made before the hint
    lance.write_dataset(rows(10), table.uri, mode="append")
    assert newest_fragment_bytes() < 250_000  # compressed, whatever the rows said
    assert adopt_encodings(table, hinted) == ["image"]
    lance.write_dataset(rows(20), table.uri, mode="append")
    assert newest_fragment_bytes() >= 500_000  # stored as they are
    assert adopt_encodings(table, hinted) == []
    assert table.open().count_rows() == 30
