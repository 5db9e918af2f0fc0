import lance
import pyarrow as pa
import pytest

from prx_assets.storage.layout import Storage, as_storage
from prx_assets.storage.tables import CORPUS, DUPLICATES, GLOBAL, PER_SOURCE, RAW_IMAGES


def test_tables_follow_the_design_layout(tmp_path):
    storage = Storage(str(tmp_path))
    assert storage.table(RAW_IMAGES, "web").uri == f"{tmp_path}/lance/raw_images/web.lance"
    assert str(storage.table(CORPUS)) == f"{tmp_path}/lance/corpus.lance"
    assert (storage.mds_root / "web").uri == f"{tmp_path}/mds/web"
    assert storage.opt_outs_dir.uri == f"{tmp_path}/opt_outs"
    assert set(PER_SOURCE).isdisjoint(GLOBAL)


def test_a_relative_root_becomes_absolute_and_object_store_uris_are_kept(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert Storage("data").root == str(tmp_path / "data")
    bucket = Storage("s3://bucket/prefix/")
    assert bucket.root == "s3://bucket/prefix" and not bucket.is_local
    assert bucket.table(DUPLICATES).uri == "s3://bucket/prefix/lance/duplicates.lance"
    with pytest.raises(NotImplementedError, match="s3://bucket/prefix/opt_outs"):
        bucket.opt_outs_dir.path  # noqa: B018 (the property is what raises)


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
    table = Storage(str(tmp_path)).table(RAW_IMAGES, "web")
    assert table.latest_version() is None and not table.exists()
    with pytest.raises(FileNotFoundError, match=r"raw_images/web\.lance"):
        table.open()
    lance.write_dataset(pa.table({"id": ["a"]}), table.uri)
    lance.write_dataset(pa.table({"id": ["b"]}), table.uri, mode="append")
    assert table.latest_version() == 2
    assert table.at(1).count_rows() == 1 and table.count_rows() == 2
    assert table.pinned() == table.at(2) and table.at(1).pinned().version == 1


def test_handles_never_print_their_credentials(tmp_path):
    storage = Storage("s3://bucket/p", {"aws_access_key_id": "AKIDSECRET1",
                                        "secret_access_key": "SECRET2", "region": "eu-west-1"})
    handles = [storage, storage.table(CORPUS), storage.table(RAW_IMAGES, "web").at(3),
               storage.mds_root / "web", storage.settings]
    printed = " ".join(f"{h!r} {h}" for h in handles)
    assert "AKIDSECRET1" not in printed and "SECRET2" not in printed
    assert "eu-west-1" in repr(storage.settings)  # what is not secret still shows
    assert storage.table(CORPUS).lance_options()["aws_secret_access_key"] == "SECRET2"
