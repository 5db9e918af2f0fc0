"""Listing a source: sorted and streaming, and an incomplete listing fails naming where."""

import os
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from prx_assets.stages.ingest import listing
from prx_assets.stages.ingest.location import SourceLocation
from prx_assets.stages.ingest.sources import SourceSpec
from prx_assets.storage.object_store import StoreSettings


def spec(kind: str, **kwargs) -> SourceSpec:
    return SourceSpec(name="src", kind=kind, uri="unused", **kwargs)


def test_image_folder_listing_is_recursive_sorted_and_filtered(small_folder: Path):
    units = list(listing.list_units(spec("image_folder"), small_folder))
    assert units == ["a/b/two.png", "a/one.jpg", "anim.png", "cut.jpg", "dangling.jpg",
                     "empty.jpg", "notes.jpg", "three.webp"]


def _unlistable(monkeypatch, folder: Path) -> None:
    """os.scandir refuses `folder` as it would without permission (tests run as root, so a
    chmod would not stop them)."""
    scandir = os.scandir

    def refusing(path):
        if Path(path) == folder:
            raise PermissionError(13, "Permission denied", str(path))
        return scandir(path)

    monkeypatch.setattr(listing.os, "scandir", refusing)


def test_unlistable_folder_fails_the_listing_naming_it(small_folder: Path, monkeypatch):
    _unlistable(monkeypatch, small_folder / "a" / "b")
    with pytest.raises(listing.ListingError, match=r"folder .*/a/b.*PermissionError"):
        list(listing.list_units(spec("image_folder"), small_folder))


def test_unlistable_source_root_fails_the_listing(small_folder: Path, monkeypatch):
    _unlistable(monkeypatch, small_folder)
    with pytest.raises(listing.ListingError, match="Permission denied"):
        list(listing.list_units(spec("image_folder"), small_folder))


def test_an_object_store_list_error_fails_the_listing_naming_the_prefix(
        small_folder: Path, monkeypatch):
    """The object-store walk, over a local file system whose listing of one prefix fails as
    an S3 ListObjects error would (an OSError from pyarrow)."""

    class FailingListing:
        def get_file_info(self, selector: pafs.FileSelector) -> list[pafs.FileInfo]:
            if selector.base_dir.endswith("/a/b"):
                raise OSError("When listing objects under key 'a/b': AWS Error SLOW_DOWN")
            return pafs.LocalFileSystem().get_file_info(selector)

    monkeypatch.setattr(SourceLocation, "filesystem",
                        lambda self: (FailingListing(), str(small_folder)))
    # The object-store walk names paths `bucket/prefix`: here the folder's absolute path.
    location = SourceLocation(f"s3://{small_folder}", settings=StoreSettings.resolve("s3://b/p"))
    with pytest.raises(listing.ListingError, match=r"prefix s3://.*/a/b/.*SLOW_DOWN"):
        list(listing.list_unit_entries(spec("image_folder"), location))


def test_missing_source_path_names_source_and_path(tmp_path: Path):
    with pytest.raises(listing.SourceNotFoundError, match=r"source 'src'.*nowhere"):
        list(listing.list_units(spec("image_folder"), tmp_path / "nowhere"))
