"""Per-kind source readers as plain generators: a *unit* (a file, a tar, a parquet file)
expands into the items it holds. Ray parallelises over units (see `ingest.py`); nothing
here needs Ray, so every bad-input case is testable in isolation.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tarfile
from pathlib import Path, PurePosixPath
from typing import Iterator

import pyarrow.parquet as pq

from prx_assets.s1_ingest.probe import STATUS_MISSING_IMAGE, STATUS_UNREADABLE, STATUS_UNSAFE_PATH
from prx_assets.s1_ingest.raw_rows import FoundItem
from prx_assets.s1_ingest.sources import SourceSpec

IMAGE_FOLDER_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp")
DEFAULT_MAX_FILE_BYTES = 512 << 20  # a single image above this is refused, not loaded
STATUS_FILE_TOO_LARGE = "file_too_large"
STATUS_UNREADABLE_FOLDER = "unreadable_folder"


class SourceNotFoundError(FileNotFoundError):
    """The source's uri does not exist; names the source and the path."""


def check_source_exists(spec: SourceSpec, uri: Path) -> None:
    if not uri.exists():
        raise SourceNotFoundError(f"source {spec.name!r} ({spec.kind}): path not found: {uri}")


def list_units(spec: SourceSpec, uri: Path) -> Iterator[str]:
    """Paths (relative to `uri`, POSIX, sorted per directory) of the units to read, and a
    `folder_unit` for each folder that could not be listed."""
    check_source_exists(spec, uri)
    if spec.kind == "image_folder":
        suffixes: tuple[str, ...] = IMAGE_FOLDER_EXTENSIONS
    elif spec.kind == "webdataset":
        suffixes = (".tar",)
    elif spec.kind == "parquet":
        suffixes = (".parquet",)
    else:
        raise ValueError(f"kind {spec.kind!r} is not read unit by unit")
    if uri.is_file():
        yield uri.name
        return
    yield from _walk_sorted(uri, uri, suffixes)


def _walk_sorted(root: Path, directory: Path, suffixes: tuple[str, ...]) -> Iterator[str]:
    """A streaming, deterministic recursive walk (no full listing held in memory).

    A folder that cannot be listed becomes a unit of its own (see `folder_unit`), so its
    images are not dropped silently: the partition gets a row saying which folder and why.
    """
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except OSError as exc:
        yield folder_unit(directory.relative_to(root).as_posix(), exc)
        return
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            yield from _walk_sorted(root, Path(entry.path), suffixes)
        elif entry.name.lower().endswith(suffixes):
            yield Path(entry.path).relative_to(root).as_posix()


# An unlistable folder's unit: its path, a "/" (no listed file ends with one), a NUL (no
# POSIX path holds one) and the error, so the unit alone carries everything its row needs.
_FOLDER_UNIT_MARK = "/\0"


def folder_unit(rel: str, exc: OSError) -> str:
    return f"{rel}{_FOLDER_UNIT_MARK}{type(exc).__name__}: {exc}"


def is_folder_unit(unit: str) -> bool:
    return _FOLDER_UNIT_MARK in unit


def unreadable_folder_item(unit: str) -> FoundItem:
    """The row of a folder that could not be listed: key `<folder>/`, the cause in `error`."""
    folder, _, error = unit.partition(_FOLDER_UNIT_MARK)
    return FoundItem(key=f"{folder}/", status=STATUS_UNREADABLE_FOLDER,
                     error=f"folder {folder}/ could not be listed, its files were not read: "
                           f"{error}")


def read_file_bytes(path: Path, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES) -> FoundItem | bytes:
    """The file's bytes, or a FoundItem that records why they could not be read."""
    try:
        size = path.stat().st_size
        if size > max_file_bytes:
            return FoundItem(key="", status=STATUS_FILE_TOO_LARGE,
                             error=f"{size:,} bytes exceeds the {max_file_bytes:,} byte cap")
        return path.read_bytes()
    except OSError as exc:
        return FoundItem(key="", status=STATUS_UNREADABLE, error=f"{type(exc).__name__}: {exc}")


def _with_key(found: FoundItem | bytes, key: str, caption: str | None) -> FoundItem:
    if isinstance(found, FoundItem):
        return FoundItem(key=key, caption=caption, status=found.status, error=found.error)
    return FoundItem(key=key, data=found, caption=caption)


def read_image_file(spec: SourceSpec, uri: Path, rel: str,
                    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES) -> FoundItem:
    path = uri / rel if uri.is_dir() else uri
    caption = _read_text(path.with_suffix(spec.caption_suffix))
    return _with_key(read_file_bytes(path, max_file_bytes), rel, caption)


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8", errors="replace").strip() or None
    except OSError:
        return None


def _is_unsafe_member(name: str) -> bool:
    """Absolute paths and `..` components would escape an extraction root."""
    pure = PurePosixPath(name)
    return name.startswith(("/", "\\")) or pure.is_absolute() or ".." in pure.parts


def _split_wds_name(name: str) -> tuple[str, str]:
    """WebDataset convention: the key is the path up to the first dot of the basename."""
    directory, _, base = name.removeprefix("./").rpartition("/")
    stem, dot, ext = base.partition(".")
    key = f"{directory}/{stem}" if directory else stem
    return key, ext.lower() if dot else ""


def read_tar(spec: SourceSpec, uri: Path, rel: str,
             max_file_bytes: int = DEFAULT_MAX_FILE_BYTES) -> Iterator[FoundItem]:
    """Stream a WebDataset shard: members grouped by key, never extracted to disk."""
    path = uri / rel if uri.is_dir() else uri
    current_key: str | None = None
    sample: dict[str, bytes] = {}
    try:
        with tarfile.open(path, mode="r|*") as tar:
            for member in tar:
                if member.isdir():
                    continue
                if _is_unsafe_member(member.name) or not member.isfile():
                    yield FoundItem(key=f"{rel}/{member.name}", status=STATUS_UNSAFE_PATH,
                                    error=f"tar member {member.name!r} is a link or escapes the root")
                    continue
                key, ext = _split_wds_name(member.name)
                if key != current_key:
                    if current_key is not None:
                        yield _wds_sample(spec, rel, current_key, sample)
                    current_key, sample = key, {}
                if member.size > max_file_bytes:
                    sample[ext] = b""
                    sample["__too_large__"] = str(member.size).encode()
                    continue
                extracted = tar.extractfile(member)
                sample[ext] = extracted.read() if extracted is not None else b""
            if current_key is not None:
                yield _wds_sample(spec, rel, current_key, sample)
    except (OSError, tarfile.TarError, EOFError) as exc:
        if current_key is not None and sample:
            yield _wds_sample(spec, rel, current_key, sample, truncated=True)
        yield FoundItem(key=f"{rel}#tar", status=STATUS_UNREADABLE,
                        error=f"tar shard {rel}: {type(exc).__name__}: {exc}")


def _wds_sample(spec: SourceSpec, rel: str, key: str, sample: dict[str, bytes],
                truncated: bool = False) -> FoundItem:
    full_key = f"{rel}/{key}"
    caption = _wds_caption(spec, sample)
    if "__too_large__" in sample:
        return FoundItem(key=full_key, caption=caption, status=STATUS_FILE_TOO_LARGE,
                         error=f"member of {int(sample['__too_large__']):,} bytes exceeds the cap")
    image_ext = next((e for e in spec.image_extensions if e in sample), None)
    if image_ext is None:
        return FoundItem(key=full_key, caption=caption, status=STATUS_MISSING_IMAGE,
                         error=f"no member with extension {'/'.join(spec.image_extensions)}")
    if truncated:
        return FoundItem(key=full_key, caption=caption, status=STATUS_UNREADABLE,
                         error="tar shard ended inside this sample")
    return FoundItem(key=full_key, data=sample[image_ext], caption=caption,
                     url=_wds_url(spec, sample))


def _wds_url(spec: SourceSpec, sample: dict[str, bytes]) -> str | None:
    if "json" not in sample:
        return None
    try:
        value = json.loads(sample["json"]).get(spec.url_field)
    except (ValueError, AttributeError):
        return None
    return str(value).strip() or None if value else None


def _wds_caption(spec: SourceSpec, sample: dict[str, bytes]) -> str | None:
    if spec.caption_extension in sample and spec.caption_extension != "json":
        return sample[spec.caption_extension].decode("utf-8", errors="replace").strip() or None
    if "json" in sample:
        try:
            value = json.loads(sample["json"]).get(spec.caption_field)
        except (ValueError, AttributeError):
            return None
        return str(value).strip() if value else None
    if "txt" in sample:
        return sample["txt"].decode("utf-8", errors="replace").strip() or None
    return None


def read_parquet_file(spec: SourceSpec, uri: Path, rel: str, batch_rows: int = 256,
                      max_file_bytes: int = DEFAULT_MAX_FILE_BYTES) -> Iterator[FoundItem]:
    """Stream a parquet file in record batches; images are bytes or paths under the uri."""
    path = uri / rel if uri.is_dir() else uri
    base = path.parent
    columns = [spec.image_column] + [c for c in (spec.key_column, spec.caption_column,
                                                 spec.url_column) if c]
    try:
        parquet = pq.ParquetFile(path)
        missing = [c for c in columns if c not in parquet.schema_arrow.names]
        if missing:
            yield FoundItem(key=f"{rel}#file", status=STATUS_UNREADABLE,
                            error=f"parquet {rel}: missing column(s) {', '.join(missing)}")
            return
        row_index = 0
        for batch in parquet.iter_batches(batch_size=batch_rows, columns=columns):
            for record in batch.to_pylist():
                key = (str(record[spec.key_column]) if spec.key_column
                       else f"{rel}#{row_index}")
                row_index += 1
                caption = record.get(spec.caption_column) if spec.caption_column else None
                item = _parquet_item(spec, base, key, record[spec.image_column], caption,
                                     max_file_bytes)
                yield _with_url(item, record.get(spec.url_column) if spec.url_column else None)
    except (OSError, ValueError) as exc:  # arrow raises ArrowInvalid (a ValueError)
        yield FoundItem(key=f"{rel}#file", status=STATUS_UNREADABLE,
                        error=f"parquet {rel}: {type(exc).__name__}: {exc}")


def _parquet_item(spec: SourceSpec, base: Path, key: str, value: object,
                  caption: object, max_file_bytes: int) -> FoundItem:
    caption_text = str(caption).strip() if caption else None
    if value is None:
        return FoundItem(key=key, caption=caption_text, status=STATUS_MISSING_IMAGE,
                         error=f"column {spec.image_column!r} is null")
    if spec.image_is_path or isinstance(value, str):
        relative = str(value)
        if _is_unsafe_member(relative):
            return FoundItem(key=key, caption=caption_text, status=STATUS_UNSAFE_PATH,
                             error=f"image path {relative!r} escapes the source folder")
        return _with_key(read_file_bytes(base / relative, max_file_bytes), key, caption_text)
    return FoundItem(key=key, data=bytes(value), caption=caption_text)


def lance_record_item(spec: SourceSpec, record: dict) -> FoundItem:
    """One row of an existing Lance table as a found item."""
    key = str(record[spec.key_column])
    caption = record.get(spec.caption_column) if spec.caption_column else None
    data = record.get(spec.image_column)
    url = record.get(spec.url_column) if spec.url_column else None
    if data is None:
        return _with_url(FoundItem(key=key, caption=caption, status=STATUS_MISSING_IMAGE,
                                   error=f"column {spec.image_column!r} is null"), url)
    return _with_url(FoundItem(key=key, data=bytes(data), caption=caption), url)


def _with_url(item: FoundItem, url: object) -> FoundItem:
    text = str(url).strip() if url else ""
    return dataclasses.replace(item, url=text) if text else item
