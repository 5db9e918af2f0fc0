"""Per-kind source readers as plain generators: a *unit* (a file, a tar, a parquet file)
expands into the items it holds. Ray parallelises over units (see `ingest.py`); nothing
here needs Ray, so every bad-input case is testable in isolation.
"""

from __future__ import annotations

import dataclasses
import json
import os
import posixpath
import tarfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path, PurePosixPath

import pyarrow as pa
import pyarrow.parquet as pq

from prx_assets.stages.ingest.listing import LANCE_UNIT_PREFIX, source_location
from prx_assets.stages.ingest.location import SourceLocation
from prx_assets.stages.ingest.probe import (
    STATUS_MISSING_IMAGE,
    STATUS_UNREADABLE,
    STATUS_UNSAFE_PATH,
)
from prx_assets.stages.ingest.raw_rows import FoundItem
from prx_assets.stages.ingest.sources import SourceSpec

DEFAULT_MAX_FILE_BYTES = 512 << 20  # a single image above this is refused, not loaded
STATUS_FILE_TOO_LARGE = "file_too_large"
STATUS_BAD_SCHEMA = "bad_schema"  # a file or table whose columns cannot hold what they name
STATUS_NULL_KEY = "null_key"
STATUS_DUPLICATE_KEY = "duplicate_key"


def read_file_bytes(location: SourceLocation, path: str,
                    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES) -> FoundItem | bytes:
    """The file's bytes, or a FoundItem that records why they could not be read (the size
    is checked before anything is loaded)."""
    try:
        with location.filesystem()[0].open_input_file(path) as handle:
            size = handle.size()
            if size > max_file_bytes:
                return FoundItem(key="", status=STATUS_FILE_TOO_LARGE,
                                 error=f"{size:,} bytes exceeds the {max_file_bytes:,} byte cap")
            return handle.read()
    except OSError as exc:
        return FoundItem(key="", status=STATUS_UNREADABLE, error=f"{type(exc).__name__}: {exc}")


def provenance_of(names: Mapping[str, tuple[str, ...]], record: Mapping[str, object]
                  ) -> dict[str, object] | None:
    """The provenance fields a sidecar or row holds (`SourceSpec.provenance_names`), None
    when it holds none."""
    found: dict[str, object] = {}
    for field, candidates in names.items():
        for name in candidates:
            value = record.get(name)
            if value is not None and str(value).strip():
                found[field] = value
                break
    return found or None


def provenance_columns(spec: SourceSpec, available: Iterable[str]) -> list[str]:
    """The provenance columns a Parquet file or Lance table has (absent ones are no error:
    most sources have none)."""
    present = set(available)
    return sorted({n for names in spec.provenance_names().values() for n in names
                   if n in present})


def _with_key(found: FoundItem | bytes, key: str, caption: str | None) -> FoundItem:
    if isinstance(found, FoundItem):
        return FoundItem(key=key, caption=caption, status=found.status, error=found.error)
    return FoundItem(key=key, data=found, caption=caption)


def read_image_file(spec: SourceSpec, uri: SourceLocation | Path, rel: str,
                    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES) -> FoundItem:
    location = source_location(uri)
    path = location.path_of(rel)
    if not _inside_root(location, path):
        return FoundItem(key=rel, status=STATUS_UNSAFE_PATH,
                         error=f"{rel} is a link to a file outside the source folder; not "
                               "read (copy the file into the source to ingest it)")
    caption_path = str(PurePosixPath(path).with_suffix(spec.caption_suffix))
    caption = _read_text(location, caption_path) if _inside_root(location, caption_path) \
        else None
    return _with_key(read_file_bytes(location, path, max_file_bytes), rel, caption)


def _inside_root(location: SourceLocation, path: str) -> bool:
    """Whether a local path, links followed, stays under the source's folder (an object
    store has no links: always)."""
    if not location.is_local:
        return True
    root = Path(location.uri)
    root = root.parent if location.single_file else root
    real = Path(os.path.realpath(path))
    return real.is_relative_to(Path(os.path.realpath(root)))


def _read_text(location: SourceLocation, path: str) -> str | None:
    try:
        with location.filesystem()[0].open_input_stream(path) as handle:
            data = handle.read()
    except OSError:
        return None
    return data.decode("utf-8", errors="replace").strip() or None


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


def read_tar(spec: SourceSpec, uri: SourceLocation | Path, rel: str,
             max_file_bytes: int = DEFAULT_MAX_FILE_BYTES) -> Iterator[FoundItem]:
    """Stream a WebDataset shard from an input stream (a local file or an object read
    front to back): members grouped by key, never extracted, never downloaded whole."""
    location = source_location(uri)
    current_key: str | None = None
    sample: dict[str, bytes] = {}
    try:
        with location.filesystem()[0].open_input_stream(location.path_of(rel)) as stream, \
                tarfile.open(fileobj=stream, mode="r|*") as tar:
            for member in tar:
                if member.isdir():
                    continue
                if _is_unsafe_member(member.name) or not member.isfile():
                    yield FoundItem(
                        key=f"{rel}/{member.name}", status=STATUS_UNSAFE_PATH,
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
    sidecar = _wds_json(sample)
    return FoundItem(key=full_key, data=sample[image_ext], caption=caption,
                     url=_wds_url(spec, sidecar),
                     meta=provenance_of(spec.provenance_names(), sidecar) if sidecar else None)


def _wds_json(sample: dict[str, bytes]) -> dict:
    """The sample's `.json` member as a dict ({} when absent or not a JSON object)."""
    if "json" not in sample:
        return {}
    try:
        value = json.loads(sample["json"])
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _wds_url(spec: SourceSpec, sidecar: dict) -> str | None:
    value = sidecar.get(spec.url_field)
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


def read_parquet_file(spec: SourceSpec, uri: SourceLocation | Path, rel: str,
                      batch_rows: int = 256, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
                      ) -> Iterator[FoundItem]:
    """Stream a parquet file in record batches through the file system (ranged reads on an
    object store); images are bytes or paths relative to the file's folder. The schema is
    checked before any row is read; null and repeated keys get row reasons."""
    location = source_location(uri)
    path = location.path_of(rel)
    base = str(PurePosixPath(path).parent)
    columns = [spec.image_column] + [c for c in (spec.key_column, spec.caption_column,
                                                 spec.url_column) if c]
    names = spec.provenance_names()
    try:
        parquet = pq.ParquetFile(location.filesystem()[0].open_input_file(path))
        missing = [c for c in columns if c not in parquet.schema_arrow.names]
        columns += provenance_columns(spec, parquet.schema_arrow.names)
        if missing:
            yield FoundItem(key=f"{rel}#file", status=STATUS_UNREADABLE,
                            error=f"parquet {rel}: missing column(s) {', '.join(missing)}")
            return
        problem = schema_problem(spec, parquet.schema_arrow)
        if problem:
            yield FoundItem(key=f"{rel}#file", status=STATUS_BAD_SCHEMA,
                            error=f"parquet {rel}: {problem}")
            return
        keys = _Keys(spec, rel)
        for batch in parquet.iter_batches(batch_size=batch_rows, columns=columns):
            for record in batch.to_pylist():
                key, refused = keys.next(record)
                if refused is not None:
                    yield refused
                    continue
                caption = record.get(spec.caption_column) if spec.caption_column else None
                item = _parquet_item(spec, location, base, key, record[spec.image_column],
                                     caption, max_file_bytes)
                item = _with_url(item, record.get(spec.url_column) if spec.url_column else None)
                yield dataclasses.replace(item, meta=provenance_of(names, record))
    except (OSError, ValueError) as exc:  # arrow raises ArrowInvalid (a ValueError)
        yield FoundItem(key=f"{rel}#file", status=STATUS_UNREADABLE,
                        error=f"parquet {rel}: {type(exc).__name__}: {exc}")


def schema_problem(spec: SourceSpec, schema: pa.Schema) -> str | None:
    """What is wrong with a parquet file's or Lance table's columns for `spec` (the column,
    its type and the fix), None when they can be read: the image column must hold bytes
    (binary) or, with `image_is_path`, strings; key, caption and url columns scalars."""
    image = schema.field(spec.image_column).type
    wanted = "string" if spec.image_is_path else "binary"
    fits = (pa.types.is_string(image) or pa.types.is_large_string(image)) if spec.image_is_path \
        else (pa.types.is_binary(image) or pa.types.is_large_binary(image)
              or pa.types.is_fixed_size_binary(image) or pa.types.is_string(image)
              or pa.types.is_large_string(image))
    if not fits:
        return (f"column {spec.image_column!r} is {image}, not {wanted}: point `image_column` "
                f"at the column holding the image {'paths' if spec.image_is_path else 'bytes'}")
    for role in ("key_column", "caption_column", "url_column"):
        name = getattr(spec, role)
        if name and pa.types.is_nested(schema.field(name).type):
            return (f"column {name!r} ({role}) is {schema.field(name).type}, not a scalar: "
                    f"set `{role}` to a string or integer column")
    return None


class _Keys:
    """Row keys of one file or fragment: the key column's value (or the row's position
    without one); a null or repeated value is refused with a row reason, keyed by position
    so that it cannot take another row's id."""

    def __init__(self, spec: SourceSpec, rel: str):
        self.spec, self.rel = spec, rel
        self.row = 0
        self.first_row: dict[str, int] = {}

    def next(self, record: dict) -> tuple[str, FoundItem | None]:
        row, self.row = self.row, self.row + 1
        column = self.spec.key_column
        if not column:
            return f"{self.rel}#{row}", None
        value = record[column]
        if value is None:
            return "", FoundItem(key=f"{self.rel}#{row}", status=STATUS_NULL_KEY,
                                 error=f"key column {column!r} is null in row {row} of "
                                       f"{self.rel}: fill it, or drop `key_column` to key "
                                       "rows by position")
        key = str(value)
        first = self.first_row.setdefault(key, row)
        if first != row:
            return "", FoundItem(key=f"{self.rel}#{row}", status=STATUS_DUPLICATE_KEY,
                                 error=f"key {key!r} of column {column!r} is also row {first} "
                                       f"of {self.rel}: keys must be unique; the first row "
                                       "is kept")
        return key, None


def _parquet_item(spec: SourceSpec, location: SourceLocation, base: str, key: str,
                  value: bytes | str | None, caption: object, max_file_bytes: int
                  ) -> FoundItem:
    caption_text = str(caption).strip() if caption else None
    if value is None:
        return FoundItem(key=key, caption=caption_text, status=STATUS_MISSING_IMAGE,
                         error=f"column {spec.image_column!r} is null")
    if not isinstance(value, (bytes, str)):  # the schema check lets no other type through
        return FoundItem(key=key, caption=caption_text, status=STATUS_BAD_SCHEMA,
                         error=f"column {spec.image_column!r} holds {type(value).__name__}")
    if spec.image_is_path or isinstance(value, str):
        relative = str(value)
        if _is_unsafe_member(relative):
            return FoundItem(key=key, caption=caption_text, status=STATUS_UNSAFE_PATH,
                             error=f"image path {relative!r} escapes the source folder")
        path = posixpath.normpath(f"{base}/{relative}")
        return _with_key(read_file_bytes(location, path, max_file_bytes), key, caption_text)
    return FoundItem(key=key, data=bytes(value), caption=caption_text)


def read_lance_fragment(spec: SourceSpec, location: SourceLocation, unit: str, version: str,
                        batch_rows: int = 256) -> Iterator[FoundItem]:
    """The rows of one fragment of the source table, at the version its signature names."""
    table = location.as_table(int(version.removeprefix("v"))).open()
    fragment = table.get_fragment(int(unit.removeprefix(LANCE_UNIT_PREFIX)))
    assert fragment is not None, unit  # listed from this very version of the table
    columns = [c for c in (spec.key_column, spec.image_column, spec.caption_column,
                           spec.url_column) if c]
    missing = [c for c in columns if c not in table.schema.names]
    problem = (f"missing column(s) {', '.join(missing)}" if missing
               else schema_problem(spec, table.schema))
    if problem:
        yield FoundItem(key=f"{unit}#file", status=STATUS_BAD_SCHEMA,
                        error=f"lance {location.uri} {unit}: {problem}")
        return
    keys = _Keys(spec, unit)
    columns += provenance_columns(spec, table.schema.names)
    names = spec.provenance_names()
    for batch in fragment.to_batches(columns=columns, batch_size=batch_rows):
        for record in batch.to_pylist():
            key, refused = keys.next(record)
            yield refused if refused is not None else dataclasses.replace(
                lance_record_item(spec, record, key), meta=provenance_of(names, record))


def lance_record_item(spec: SourceSpec, record: dict, key: str | None = None) -> FoundItem:
    """One row of an existing Lance table as a found item."""
    key = key if key is not None else str(record[spec.key_column])
    caption = record.get(spec.caption_column) if spec.caption_column else None
    data = record.get(spec.image_column)
    url = record.get(spec.url_column) if spec.url_column else None
    if data is None:
        return _with_url(FoundItem(key=key, caption=caption, status=STATUS_MISSING_IMAGE,
                                   error=f"column {spec.image_column!r} is null"), url)
    if not isinstance(data, bytes):  # a Lance source holds the image bytes themselves
        return FoundItem(key=key, status=STATUS_BAD_SCHEMA,
                         error=f"column {spec.image_column!r} holds {type(data).__name__}, "
                               "not image bytes")
    return _with_url(FoundItem(key=key, data=data, caption=caption), url)


def _with_url(item: FoundItem, url: object) -> FoundItem:
    text = str(url).strip() if url else ""
    return dataclasses.replace(item, url=text) if text else item
