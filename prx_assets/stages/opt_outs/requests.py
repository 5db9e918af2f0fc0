"""Opt-out requests: the file format every door writes and the one parser that reads it.

A request file sits in `Storage.opt_outs_dir` (`$PRX_DATA_ROOT/opt_outs/*.csv|*.jsonl`). A
request names an image by one key: its corpus `id`, the `sha256` of its original bytes,
its `source_key` (the item's key inside its source; an optional `source` field narrows
it to one source) or the `url` it was fetched from (raw_images' `url` column, recorded at
ingest when the source carries one). Each request also carries a `timestamp` (ISO 8601)
and a free-text `reference`; `requested_by` and `door` (`browser`, `cli`, `file`) say who
asked and how.

Malformed rows are collected with their file and line and never stop the valid ones.

The CLI (`prx-assets opt-out`) and the browser (an authenticated curator; who may write is
decided in `browser.auth`) write through `write_requests`: one new file per call, each
record checked with `parse_request` before anything lands, so what lands is valid. A new
file is a new request for the sensor's cursor, and writing it (`Location.write_text`: a
hidden temporary file renamed into place, or one PUT on S3) can never tear a file another
process reads.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from prx_assets.storage import object_store
from prx_assets.storage.layout import Storage, as_storage
from prx_assets.storage.refs import Location

KEY_TYPES = ("id", "sha256", "source_key", "url")
REQUIRED_FIELDS = ("key_type", "value", "timestamp", "reference")
REQUEST_SUFFIXES = (".csv", ".jsonl")
SHA256 = re.compile(r"^[0-9a-f]{64}$")
DOORS = ("browser", "cli", "file")
MAX_REFERENCE = 500
WRITTEN_SUFFIX = ".jsonl"  # what `write_requests` writes


@dataclass(frozen=True)
class OptOutRequest:
    file: str
    line: int
    key_type: str
    value: str
    requested_at: datetime
    reference: str
    source: str | None = None
    requested_by: str | None = None  # the curator (browser) or user (CLI); file: optional
    door: str = "file"

    @property
    def request_id(self) -> str:
        return f"{self.file}:{self.line}"


@dataclass(frozen=True)
class RowError:
    file: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.message}"


@dataclass
class ParsedRequests:
    requests: list[OptOutRequest] = field(default_factory=list)
    errors: list[RowError] = field(default_factory=list)

    def extend(self, other: ParsedRequests) -> None:
        self.requests += other.requests
        self.errors += other.errors


@dataclass(frozen=True)
class RequestFile:
    """One request file as read: its bytes (None when unreadable, with the reason)."""

    name: str
    data: bytes | None
    unreadable: str | None = None

    @property
    def fingerprint(self) -> str:
        """Content hash: a rewritten file counts as new, a touched one does not."""
        return hashlib.sha256(self.data or b"").hexdigest()[:16]

    def parse(self) -> ParsedRequests:
        """Every valid request of the file, and every malformed row with its line number."""
        parsed = ParsedRequests()
        if self.data is None:
            parsed.errors.append(RowError(self.name, 0, f"unreadable: {self.unreadable}"))
            return parsed
        try:
            text = self.data.decode("utf-8")
        except UnicodeDecodeError as exc:
            parsed.errors.append(RowError(self.name, 0, f"unreadable: {exc}"))
            return parsed
        rows = _csv_rows(text) if self.name.endswith(".csv") else _jsonl_rows(text)
        for line, record in rows:
            try:
                if isinstance(record, Exception):
                    raise record
                parsed.requests.append(parse_request(record, self.name, line))
            except ValueError as exc:
                parsed.errors.append(RowError(self.name, line, str(exc)))
        return parsed


def request_files(directory: Location) -> list[Location]:
    """Request files in name order (hidden and temporary files are not requests); a folder
    that does not exist (no request yet; on S3, no object under the prefix) has none."""
    return [file for file in directory.files()
            if file.name.endswith(REQUEST_SUFFIXES) and not file.name.startswith(".")]


def read_request_file(location: Location) -> RequestFile:
    try:
        return RequestFile(location.name, location.read_bytes())
    except object_store.ObjectStoreError:
        raise  # the store itself is unusable: not a property of this one file
    except OSError as exc:  # removed since the listing, say
        return RequestFile(location.name, None, str(exc))


def read_request_files(directory: Location) -> list[RequestFile]:
    return [read_request_file(location) for location in request_files(directory)]


def fingerprint(location: Location) -> str:
    return read_request_file(location).fingerprint


def request_fingerprints(directory: Location) -> dict[str, str]:
    """Request file -> fingerprint, for the files that could be read: what is new."""
    return {f.name: f.fingerprint for f in read_request_files(directory) if f.data is not None}


def parse_file(location: Location) -> ParsedRequests:
    return read_request_file(location).parse()


def parse_files(files: Iterable[RequestFile]) -> ParsedRequests:
    parsed = ParsedRequests()
    for file in files:
        parsed.extend(file.parse())
    return parsed


def parse_directory(directory: Location) -> ParsedRequests:
    """All request files of the folder."""
    return parse_files(read_request_files(directory))


def parse_request(record: dict, file: str, line: int) -> OptOutRequest:
    """One request from a mapping of its fields; ValueError names what is wrong."""
    missing = [f for f in REQUIRED_FIELDS if record.get(f) is None]
    if missing:
        raise ValueError(f"missing field(s) {', '.join(missing)}")
    key_type = str(record["key_type"]).strip()
    value = str(record["value"]).strip()
    if key_type not in KEY_TYPES:
        raise ValueError(f"key_type {key_type!r} is not one of {', '.join(KEY_TYPES)}")
    if not value:
        raise ValueError("empty value")
    if key_type == "sha256":
        value = value.lower()
        if not SHA256.match(value):
            raise ValueError(f"sha256 {value!r} is not 64 hex digits")
    if key_type == "id" and ":" not in value:
        raise ValueError(f"id {value!r} is not of the form <source>:<hash>")
    source = _optional(record, "source")
    door = _optional(record, "door") or "file"
    if door not in DOORS:
        raise ValueError(f"door {door!r} is not one of {', '.join(DOORS)}")
    return OptOutRequest(file=file, line=line, key_type=key_type, value=value,
                         requested_at=parse_timestamp(str(record["timestamp"])),
                         reference=str(record["reference"]), source=source,
                         requested_by=_optional(record, "requested_by"), door=door)


def _optional(record: dict, name: str) -> str | None:
    value = record.get(name)
    return (str(value).strip() or None) if value is not None else None


def parse_timestamp(text: str) -> datetime:
    try:
        stamp = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"timestamp {text!r} is not ISO 8601") from None
    return stamp.replace(tzinfo=UTC) if stamp.tzinfo is None else stamp.astimezone(
        UTC)


def _jsonl_rows(text: str) -> Iterator[tuple[int, dict | Exception]]:
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except json.JSONDecodeError as exc:
            yield number, ValueError(f"not valid JSON: {exc.msg}")
            continue
        yield number, record if isinstance(record, dict) else ValueError(
            f"expected a JSON object, got {type(record).__name__}")


def _csv_rows(text: str) -> Iterator[tuple[int, dict | Exception]]:
    reader = csv.reader(io.StringIO(text))
    header: list[str] | None = None
    line = 0
    for row in reader:
        start, line = line + 1, reader.line_num
        if not any(cell.strip() for cell in row):
            continue
        if header is None:
            header = [cell.strip() for cell in row]
            absent = [f for f in REQUIRED_FIELDS if f not in header]
            if absent:
                yield start, ValueError(f"header lacks column(s) {', '.join(absent)}")
                return
            continue
        if len(row) != len(header):
            yield start, ValueError(f"expected {len(header)} columns, got {len(row)}")
            continue
        yield start, dict(zip(header, row, strict=True))


# --- the doors' writer ------------------------------------------------------------------

def write_requests(storage: Storage | str | Path, sample_ids: list[str], reference: str,
                   now: datetime | None = None, *, door: str,
                   requested_by: str | None = None, folder: Location | None = None
                   ) -> Location:
    """One new request file opting every id out (one line each, who and why on each);
    returns its location. `folder`: another audited folder of the same format (the rights
    clearances), `opt_outs_dir` by default. Each record is checked with `parse_request`
    before anything is written, so what lands is valid; the write is durable (file and
    folder flushed) and whole (renamed into place, or one PUT)."""
    if not sample_ids:
        raise ValueError("no sample id to opt out")
    now = now or datetime.now(UTC)
    reference = " ".join(str(reference or "").split())[:MAX_REFERENCE] or f"corpus {door}"
    who = {"requested_by": requested_by, "door": door} if requested_by else {"door": door}
    records = [{"key_type": "id", "value": sample_id, "timestamp": now.isoformat(),
                "reference": reference, **who} for sample_id in sample_ids]
    digest = hashlib.sha256("\n".join([*sample_ids, now.isoformat()]).encode()
                            ).hexdigest()[:10]
    name = f"{door}-{now:%Y%m%dT%H%M%S}-{digest}{WRITTEN_SUFFIX}"
    body = "".join(json.dumps(record) + "\n" for record in records)
    for line, record in enumerate(records, start=1):
        parse_request(record, name, line)  # ValueError naming what would be malformed
    target = (folder or as_storage(storage).opt_outs_dir) / name
    target.write_text(body)
    return target


def write_request(storage: Storage | str | Path, sample_id: str, reference: str,
                  now: datetime | None = None, *, door: str,
                  requested_by: str | None = None) -> Location:
    """A new request file opting `sample_id` out; returns its location."""
    return write_requests(storage, [sample_id], reference, now, door=door,
                          requested_by=requested_by)


def files_requesting(storage: Storage | str | Path, sample_id: str, door: str = "browser",
                     limit: int = 20) -> list[str]:
    """The request files `write_requests` wrote through `door` that name this sample by id
    (so the browser's page can say it was requested); a malformed line names nothing."""
    found = []
    for location in as_storage(storage).opt_outs_dir.files(WRITTEN_SUFFIX):
        if not location.name.startswith(f"{door}-"):
            continue
        requests = parse_file(location).requests
        if any(r.key_type == "id" and r.value == sample_id for r in requests):
            found.append(location.name)
            if len(found) >= limit:
                break
    return found
