import lance
import pyarrow as pa
import pytest

from prx_assets.storage.layout import Storage, as_storage
from prx_assets.storage.tables import CORPUS, DUPLICATES, GLOBAL, PER_SOURCE, RAW_IMAGES


def test_tables_follow_the_design_layout(tmp_path):
    storage = Storage(str(tmp_path))
    assert storage.table(RAW_IMAGES, "web") == f"{tmp_path}/lance/raw_images/web.lance"
    assert storage.table(CORPUS) == f"{tmp_path}/lance/corpus.lance"
    assert storage.mds_tree("web") == f"{tmp_path}/mds/web"
    assert storage.opt_outs_dir == f"{tmp_path}/opt_outs"
    assert set(PER_SOURCE).isdisjoint(GLOBAL)


def test_a_relative_root_becomes_absolute_and_object_store_uris_are_kept(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert Storage("data").root == str(tmp_path / "data")
    bucket = Storage("s3://bucket/prefix/")
    assert bucket.root == "s3://bucket/prefix" and not bucket.is_local
    assert bucket.table(DUPLICATES) == "s3://bucket/prefix/lance/duplicates.lance"
    with pytest.raises(NotImplementedError, match="s3://bucket/prefix/opt_outs"):
        bucket.local_path(bucket.opt_outs_dir)


def test_the_root_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("PRX_DATA_ROOT", str(tmp_path / "elsewhere"))
    assert Storage.from_env().root == str(tmp_path / "elsewhere")
    assert as_storage(tmp_path).root == str(tmp_path)


def test_wrong_table_use_is_refused_by_name(tmp_path):
    storage = Storage(str(tmp_path))
    with pytest.raises(ValueError, match="per source"):
        storage.table(RAW_IMAGES)
    with pytest.raises(ValueError, match="spans every source"):
        storage.table(CORPUS, "web")
    with pytest.raises(ValueError, match="unknown table"):
        storage.table("raw_imgs", "web")


def test_open_and_versions(tmp_path):
    storage = Storage(str(tmp_path))
    assert storage.latest_version(RAW_IMAGES, "web") is None and not storage.exists(RAW_IMAGES, "web")
    with pytest.raises(FileNotFoundError, match="raw_images/web.lance"):
        storage.open(RAW_IMAGES, "web")
    uri = storage.table(RAW_IMAGES, "web")
    lance.write_dataset(pa.table({"id": ["a"]}), uri)
    lance.write_dataset(pa.table({"id": ["b"]}), uri, mode="append")
    assert storage.latest_version(RAW_IMAGES, "web") == 2
    assert storage.open(RAW_IMAGES, "web", version=1).count_rows() == 1
    assert storage.open(RAW_IMAGES, "web").count_rows() == 2
