"""Location listings: `files_below` lists every file at any depth, by relative path."""

from __future__ import annotations

from prx_assets.storage.refs import Location


def test_files_below_lists_every_file_at_any_depth_with_its_size(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "top.json").write_bytes(b"12")
    (tmp_path / "a" / "one.mds").write_bytes(b"123")
    (tmp_path / "a" / "b" / "two.mds").write_bytes(b"12345")
    (tmp_path / "empty").mkdir()
    assert Location.of(tmp_path).files_below() == {"top.json": 2, "a/one.mds": 3,
                                                   "a/b/two.mds": 5}
    assert (Location.of(tmp_path) / "a").files_below() == {"one.mds": 3, "b/two.mds": 5}
    assert (Location.of(tmp_path) / "nothing").files_below() == {}


def test_files_below_in_a_bucket_lists_every_object_under_the_prefix_only(s3_server, s3_root):
    from prx_assets.storage.layout import Storage

    root = Storage(s3_root).location()
    for name, data in {"top.json": b"12", "a/one.mds": b"123", "a/b/two.mds": b"12345"}.items():
        (root / name).write_bytes(data)
    Storage(f"{s3_root}-beside").location("a", "other.mds").write_bytes(b"1")  # same prefix
    assert root.files_below() == {"top.json": 2, "a/one.mds": 3, "a/b/two.mds": 5}
    assert (root / "a").files_below() == {"one.mds": 3, "b/two.mds": 5}
    assert (root / "nothing").files_below() == {}


def test_a_deleted_folder_that_the_server_still_lists_deletes_again_as_absent(
        s3_server, s3_root):
    """SeaweedFS lists a deleted nested folder as an empty prefix for a minute or more;
    deleting it again (a second prune of a tree version) found no object under it and
    raised FileNotFoundError (the soak on S3, seed 301, the first skip_lists_job)."""
    from prx_assets.storage.layout import Storage

    trees = Storage(s3_root).location("mds", ".trees", "pq")
    for name in ("512/640x480/shard.00000.mds", "512/640x480/index.json", "tree.json"):
        (trees / "v1" / name).write_bytes(b"1")
    (trees / "v1").delete()
    assert (trees / "v1").files_below() == {}
    (trees / "v1").delete()  # no object under it: absent, as the docstring says
    assert (trees / "v1").files_below() == {}
