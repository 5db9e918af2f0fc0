import json
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prx_assets.stages.ingest import listing, readers
from prx_assets.stages.ingest.location import SourceLocation
from prx_assets.stages.ingest.raw_rows import RAW_IMAGES_SCHEMA, raw_row
from prx_assets.stages.ingest.sources import SourceSpec
from prx_assets.testing.images import jpeg_bytes
from prx_assets.testing.tars import add_member


def spec(kind: str, **kwargs) -> SourceSpec:
    return SourceSpec(name="src", kind=kind, uri="unused", **kwargs)


def test_image_file_reader_keeps_bytes_and_sidecar_caption(small_folder: Path):
    item = readers.read_image_file(spec("image_folder"), small_folder, "a/one.jpg")
    assert item.data == (small_folder / "a/one.jpg").read_bytes()
    assert item.caption == "first caption" and item.key == "a/one.jpg"


def test_unreadable_files_are_recorded(small_folder: Path):
    item = readers.read_image_file(spec("image_folder"), small_folder, "dangling.jpg")
    assert item.status == "unreadable" and "FileNotFoundError" in item.error
    big = readers.read_image_file(spec("image_folder"), small_folder, "a/one.jpg",
                                  max_file_bytes=10)
    assert big.status == "file_too_large" and big.data is None


def make_tar(path: Path, members: list[tuple[str, bytes]]) -> Path:
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            add_member(tar, name, data)
    return path


def test_webdataset_groups_members_by_key_with_captions(tmp_path: Path):
    img = jpeg_bytes(400, 400)
    make_tar(tmp_path / "s.tar", [
        ("./dir/000.jpg", img), ("./dir/000.txt", b"a cat"),
        ("001.png", img), ("001.json", json.dumps({"caption": "a dog"}).encode()),
        ("002.txt", b"caption without image"),
    ])
    items = list(readers.read_tar(spec("webdataset"), tmp_path, "s.tar"))
    assert [(i.key, i.caption, i.status) for i in items] == [
        ("s.tar/dir/000", "a cat", None), ("s.tar/001", "a dog", None),
        ("s.tar/002", "caption without image", "missing_image")]
    assert items[0].data == img


def test_tar_members_escaping_the_root_are_recorded_never_extracted(tmp_path: Path):
    img = jpeg_bytes(400, 400)
    tar_path = make_tar(tmp_path / "evil.tar", [
        ("../../escape.jpg", img), ("/etc/abs.jpg", img), ("ok.jpg", img)])
    with tarfile.open(tar_path, "a") as tar:
        link = tarfile.TarInfo("link.jpg")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    before = set(tmp_path.parent.rglob("*"))
    items = list(readers.read_tar(spec("webdataset"), tmp_path, "evil.tar"))
    assert {i.key: i.status for i in items} == {
        "evil.tar/../../escape.jpg": "unsafe_path", "evil.tar//etc/abs.jpg": "unsafe_path",
        "evil.tar/link.jpg": "unsafe_path", "evil.tar/ok": None}
    assert set(tmp_path.parent.rglob("*")) == before  # nothing written anywhere


def test_truncated_tar_keeps_earlier_samples_and_records_the_damage(tmp_path: Path):
    img = jpeg_bytes(400, 400)
    whole = make_tar(tmp_path / "whole.tar", [("a.jpg", img), ("b.jpg", img), ("c.jpg", img)])
    (tmp_path / "cut.tar").write_bytes(whole.read_bytes()[: len(img) * 2 + 900])
    items = list(readers.read_tar(spec("webdataset"), tmp_path, "cut.tar"))
    assert items[0].key == "cut.tar/a" and items[0].status is None
    assert items[-1].status == "unreadable" and "cut.tar" in items[-1].error


def test_parquet_bytes_column_with_keys_and_captions(tmp_path: Path):
    img = jpeg_bytes(400, 400)
    pq.write_table(pa.table({"k": ["x", "y"], "img": [img, None], "cap": ["c1", None]}),
                   tmp_path / "p.parquet")
    s = spec("parquet", image_column="img", key_column="k", caption_column="cap")
    items = list(readers.read_parquet_file(s, tmp_path, "p.parquet"))
    assert [(i.key, i.caption, i.status) for i in items] == [
        ("x", "c1", None), ("y", None, "missing_image")]
    assert items[0].data == img


def test_parquet_paths_resolve_relative_and_refuse_escapes(tmp_path: Path):
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.jpg").write_bytes(jpeg_bytes(400, 400))
    pq.write_table(pa.table({"path": ["imgs/a.jpg", "../secret.jpg", "imgs/missing.jpg"]}),
                   tmp_path / "p.parquet")
    s = spec("parquet", image_column="path", image_is_path=True)
    items = list(readers.read_parquet_file(s, tmp_path, "p.parquet"))
    assert [i.key for i in items] == ["p.parquet#0", "p.parquet#1", "p.parquet#2"]
    assert [i.status for i in items] == [None, "unsafe_path", "unreadable"]


def test_parquet_missing_column_and_corrupt_file_are_recorded(tmp_path: Path):
    pq.write_table(pa.table({"other": [1]}), tmp_path / "p.parquet")
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
    s = spec("parquet", image_column="image")
    missing = list(readers.read_parquet_file(s, tmp_path, "p.parquet"))
    assert missing[0].status == "unreadable" and "missing column" in missing[0].error
    corrupt = list(readers.read_parquet_file(s, tmp_path, "bad.parquet"))
    assert corrupt[0].status == "unreadable"


def test_urls_are_kept_when_the_source_carries_them(tmp_path: Path):
    img = jpeg_bytes(400, 400)
    make_tar(tmp_path / "s.tar", [
        ("a.jpg", img), ("a.json", json.dumps({"url": " https://x.org/a.jpg "}).encode()),
        ("b.jpg", img), ("b.json", b"{broken"), ("c.jpg", img)])
    items = list(readers.read_tar(spec("webdataset"), tmp_path, "s.tar"))
    assert [i.url for i in items] == ["https://x.org/a.jpg", None, None]
    pq.write_table(pa.table({"img": [img, img], "link": ["https://x.org/p", None]}),
                   tmp_path / "p.parquet")
    s = spec("parquet", image_column="img", url_column="link")
    assert [i.url for i in readers.read_parquet_file(s, tmp_path, "p.parquet")] == [
        "https://x.org/p", None]
    row = raw_row("web", items[0])
    assert row["url"] == "https://x.org/a.jpg" and set(row) == set(RAW_IMAGES_SCHEMA.names)


def test_provenance_and_rights_fields_travel_from_sidecars_and_columns(tmp_path: Path):
    """A WebDataset `.json` and Parquet columns with provenance, under default and mapped
    names; the source's license is the fallback and `unknown` the last resort."""
    img = jpeg_bytes(400, 400)
    make_tar(tmp_path / "s.tar", [
        ("a.jpg", img), ("a.json", json.dumps({
            "license": "cc-by-sa-4.0", "license_url": "https://cc.org/by-sa/4.0/",
            "author": "Ann", "X-Robots-Tag": "noai"}).encode()),
        ("b.jpg", img), ("b.json", json.dumps({"credit": "Bob"}).encode()),
        ("c.jpg", img)])
    wds = spec("webdataset", license="cc0", provenance=(("attribution", "credit"),))
    rows = [raw_row("web", item, source_license=wds.license)
            for item in readers.read_tar(wds, tmp_path, "s.tar")]
    assert [(r["license"], r["license_url"], r["attribution"]) for r in rows] == [
        ("cc-by-sa-4.0", "https://cc.org/by-sa/4.0/", None),  # `credit` replaces the defaults
        ("cc0", None, "Bob"), ("cc0", None, None)]
    assert [(r["reservation"], r["reservation_signal"]) for r in rows] == [
        ("prohibited", "x-robots-tag=noai"), ("none", None), ("none", None)]
    pq.write_table(pa.table({"img": [img, img], "lic": ["cc-by-4.0", None],
                             "author": ["Cy", None], "tdm_reservation": [None, 1]}),
                   tmp_path / "p.parquet")
    par = spec("parquet", image_column="img", provenance=(("license", "lic"),))
    rows = [raw_row("par", item) for item in readers.read_parquet_file(par, tmp_path,
                                                                       "p.parquet")]
    assert [(r["license"], r["attribution"], r["reservation"]) for r in rows] == [
        ("cc-by-4.0", "Cy", "none"), ("unknown", None, "prohibited")]
    assert set(rows[0]) == set(RAW_IMAGES_SCHEMA.names)
    unread = raw_row("web", next(readers.read_tar(wds, tmp_path, "s.tar")), read_rights=False)
    assert unread["reservation"] == "none" and unread["license"] == "cc-by-sa-4.0"


# ------------------------------------------------------------------ sources on s3://

def test_object_store_sources_list_with_signatures_and_stream(s3_server, s3_root, tmp_path):
    """An image folder (with a caption file) and a Lance table in the bucket: the listing
    walks prefixes like folders, signatures change with a new PUT of a caption, and the
    readers stream bytes through the resolved options."""
    from prx_assets.storage.lance_tables import overwrite_rows

    bucket, prefix = s3_root.partition("://")[2].split("/", 1)
    client = s3_server.client()
    img = jpeg_bytes(400, 300)
    for key, body in (("imgs/a/one.jpg", img), ("imgs/a/one.txt", b"a caption"),
                      ("imgs/two.png", img), ("imgs/readme.md", b"not listed")):
        client.put_object(Bucket=bucket, Key=f"{prefix}/{key}", Body=body)
    folder = listing.resolve_location(spec("image_folder"), f"{s3_root}/imgs")
    entries = dict(listing.list_unit_entries(spec("image_folder"), folder))
    assert list(entries) == ["a/one.jpg", "two.png"]
    item = readers.read_image_file(spec("image_folder"), folder, "a/one.jpg")
    assert item.data == img and item.caption == "a caption"
    client.put_object(Bucket=bucket, Key=f"{prefix}/imgs/a/one.txt", Body=b"a longer caption")
    again = dict(listing.list_unit_entries(spec("image_folder"), folder))
    assert again["a/one.jpg"] != entries["a/one.jpg"] and again["two.png"] == entries["two.png"]

    table_uri = f"{s3_root}/src.lance"
    location = SourceLocation.of(table_uri)
    overwrite_rows(location.as_table(), pa.table({"key": ["k1", "k2"], "image": [img, img]}),
                   pa.schema([("key", pa.string()), ("image", pa.binary())]))
    lance_spec = spec("lance", key_column="key")
    units = list(listing.lance_unit_entries(lance_spec, listing.resolve_location(lance_spec,
                                                                                 table_uri)))
    assert [signature for _, signature in units] == ["v1"]
    items = list(readers.read_lance_fragment(lance_spec, location, *units[0]))
    assert [(i.key, i.data == img) for i in items] == [("k1", True), ("k2", True)]
    with pytest.raises(listing.SourceNotFoundError, match="nothing at"):
        listing.resolve_location(spec("webdataset"), f"{s3_root}/no-such-prefix")
