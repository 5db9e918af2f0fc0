"""Listing a source: its units (files, tars, parquet files, Lance fragments), each with
its signature (what the listing says of its content: size and mtime, or the Lance version),
streaming and sorted, locally or on an object store. A listing that is incomplete fails
(`ListingError`): a file it did not see is not a file that was removed."""

from __future__ import annotations

import os
import posixpath
from collections.abc import Iterator
from pathlib import Path

import pyarrow.fs as pafs

from prx_assets.stages.ingest.location import SourceLocation, signature
from prx_assets.stages.ingest.sources import SourceSpec

IMAGE_FOLDER_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp")


class SourceNotFoundError(FileNotFoundError):
    """The source's uri does not exist; names the source and the path."""


class ListingError(OSError):
    """A folder or prefix of the source could not be listed. The listing is incomplete, so
    the run must not act on it: a file it did not see is not a file that was removed."""

    def __init__(self, where: str, cause: OSError):
        super().__init__(f"listing {where} failed, the listing is incomplete and nothing was "
                         f"removed: {type(cause).__name__}: {cause}")
        self.where = where


UNIT_SUFFIXES = {"image_folder": IMAGE_FOLDER_EXTENSIONS, "webdataset": (".tar",),
                 "parquet": (".parquet",)}


def source_location(where: SourceLocation | Path | str) -> SourceLocation:
    return where if isinstance(where, SourceLocation) else SourceLocation.of(where)


def resolve_location(spec: SourceSpec, where: SourceLocation | Path | str) -> SourceLocation:
    """The source's location, checked: on an object store the bucket, credentials and
    endpoint first (`ObjectStoreError`), then that the path exists (`SourceNotFoundError`);
    marked `single_file` when the uri names one file rather than a folder or prefix."""
    location = source_location(where)
    location.check_reachable()
    if location.is_local:
        path = Path(location.uri)
        if not path.exists():
            raise SourceNotFoundError(
                f"source {spec.name!r} ({spec.kind}): path not found: {location.uri}")
        return location.as_single_file() if path.is_file() else location
    info = location.info()
    if info.type == pafs.FileType.NotFound:
        raise SourceNotFoundError(f"source {spec.name!r} ({spec.kind}): nothing at "
                                  f"{location.uri}")
    return location.as_single_file() if info.type == pafs.FileType.File else location


def check_source_exists(spec: SourceSpec, uri: SourceLocation | Path | str) -> None:
    resolve_location(spec, uri)


def list_units(spec: SourceSpec, uri: SourceLocation | Path | str) -> Iterator[str]:
    """Paths (relative to `uri`, POSIX, sorted per directory) of the units to read; a
    folder that cannot be listed raises `ListingError`."""
    for unit, _ in list_unit_entries(spec, resolve_location(spec, uri)):
        yield unit


def list_unit_entries(spec: SourceSpec, location: SourceLocation) -> Iterator[tuple[str, str]]:
    """(unit, signature) for every unit of a resolved location, streaming: the signature is
    what the listing says of the unit's content (`location.signature`), which decides
    whether a rerun reads it again. An image's signature includes its caption file's."""
    suffixes = UNIT_SUFFIXES.get(spec.kind)
    if suffixes is None:
        raise ValueError(f"kind {spec.kind!r} is not read unit by unit")
    if location.single_file:
        if location.is_local:
            stat = os.stat(location.uri)
            yield Path(location.uri).name, signature(stat.st_size, stat.st_mtime_ns)
        else:
            info = location.info()
            yield info.base_name, signature(info.size, info.mtime_ns)
        return
    caption = spec.caption_suffix if spec.kind == "image_folder" else None
    if location.is_local:
        root = Path(location.uri)
        yield from _walk_sorted(root, root, suffixes, caption)
    else:
        yield from _walk_store(location, location.base.rstrip("/"), "", suffixes, caption)


def _walk_sorted(root: Path, directory: Path, suffixes: tuple[str, ...],
                 caption_suffix: str | None = None, rel_dir: str = ""
                 ) -> Iterator[tuple[str, str]]:
    """A streaming, deterministic recursive walk (no full listing held in memory); a unit's
    path is built as a string (`rel_dir` + name: no Path per file, the sensor's tick is
    this walk).

    A folder that cannot be listed fails the walk (`ListingError`, naming the folder): its
    files would otherwise look removed, and their rows would be deleted.
    """
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except OSError as exc:
        raise ListingError(f"folder {directory}", exc) from exc
    by_name = {e.name: e for e in entries}
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            yield from _walk_sorted(root, Path(entry.path), suffixes, caption_suffix,
                                    f"{rel_dir}{entry.name}/")
        elif entry.name.lower().endswith(suffixes):
            sig = _local_signature(entry)
            caption_name = _caption_name(entry.name, caption_suffix)
            sibling = by_name.get(caption_name) if caption_name is not None else None
            if sibling is not None:
                sig += f"+{_local_signature(sibling)}"
            yield f"{rel_dir}{entry.name}", sig


def _local_signature(entry: os.DirEntry) -> str:
    try:
        stat = entry.stat()  # follows links: the content a read would get
    except OSError as exc:
        return f"unstatable:{type(exc).__name__}"  # read (and recorded) as unreadable
    return signature(stat.st_size, stat.st_mtime_ns)


def _caption_name(name: str, caption_suffix: str | None) -> str | None:
    """`a.jpg` -> `a.txt` (as `PurePosixPath.with_suffix`, without building a path)."""
    return posixpath.splitext(name)[0] + caption_suffix if caption_suffix else None


def _walk_store(location: SourceLocation, base: str, rel_dir: str, suffixes: tuple[str, ...],
                caption_suffix: str | None) -> Iterator[tuple[str, str]]:
    """The object-store walk: one delimited listing per prefix level, sorted, like the
    local walk (a listing failure fails the walk with `ListingError`, naming the prefix)."""
    directory = f"{base}/{rel_dir}".rstrip("/")
    try:
        infos = location.filesystem()[0].get_file_info(
            pafs.FileSelector(directory, recursive=False))
    except OSError as exc:
        raise ListingError(f"prefix s3://{directory}/", exc) from exc
    infos.sort(key=lambda i: i.base_name)
    by_name = {i.base_name: i for i in infos if i.type == pafs.FileType.File}
    for info in infos:
        rel = f"{rel_dir}{info.base_name}"
        if info.type == pafs.FileType.Directory:
            yield from _walk_store(location, base, f"{rel}/", suffixes, caption_suffix)
        elif info.type == pafs.FileType.File and info.base_name.lower().endswith(suffixes):
            sig = signature(info.size, info.mtime_ns)
            sibling = by_name.get(_caption_name(info.base_name, caption_suffix))
            if sibling is not None:
                sig += f"+{signature(sibling.size, sibling.mtime_ns)}"
            yield rel, sig


def list_source(spec: SourceSpec, location: SourceLocation) -> Iterator[tuple[str, str]]:
    """(unit, signature) of every unit of the source, streaming."""
    if spec.kind == "lance":
        return lance_unit_entries(spec, location)
    return list_unit_entries(spec, location)


# Lance sources: a unit is one fragment of the source table at the version listed; the
# signature is that version, so an unchanged table means nothing is read again.
LANCE_UNIT_PREFIX = "fragment-"


def lance_unit_entries(spec: SourceSpec, location: SourceLocation
                       ) -> Iterator[tuple[str, str]]:
    table = location.as_table().open()
    for fragment in table.get_fragments():
        yield f"{LANCE_UNIT_PREFIX}{fragment.fragment_id}", f"v{table.version}"
