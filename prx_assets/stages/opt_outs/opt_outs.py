"""Opt-out requests: parsed from `$PRX_DATA_ROOT/opt_outs/*.csv|*.jsonl`, resolved to ids.

A request names an image by one key: its corpus `id`, the `sha256` of its original bytes,
its `source_key` (the item's key inside its source; an optional `source` field narrows
it to one source) or the `url` it was fetched from (raw_images' `url` column, recorded at
ingest when the source carries one). Each request also carries a `timestamp` (ISO 8601)
and a free-text `reference`.

Malformed rows are collected with their file and line and never stop the valid ones.
Resolution scans only the key columns of each source's raw_images, in bounded batches,
and extends every match to its exact copies elsewhere: the same bytes (sha256) in any
source, and every member of its phash group in the duplicates table.
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

import pyarrow as pa
import pyarrow.compute as pc

from prx_assets.storage import object_store
from prx_assets.storage.layout import Storage, as_storage
from prx_assets.storage.refs import Location, TableRef
from prx_assets.storage.tables import DUPLICATES, RAW_IMAGES

KEY_TYPES = ("id", "sha256", "source_key", "url")
REQUIRED_FIELDS = ("key_type", "value", "timestamp", "reference")
REQUEST_SUFFIXES = (".csv", ".jsonl")
SHA256 = re.compile(r"^[0-9a-f]{64}$")
# How a resolved id was reached from its request.
VIA_DIRECT, VIA_SAME_BYTES, VIA_DUPLICATE, VIA_NO_MATCH = (
    "direct", "same_bytes", "duplicate", "no_match")

AUDIT_SCHEMA = pa.schema([
    pa.field("request_id", pa.string(), nullable=False),  # "<file>:<line>"
    pa.field("file", pa.string(), nullable=False),
    pa.field("line", pa.int32(), nullable=False),
    pa.field("key_type", pa.string(), nullable=False),
    pa.field("value", pa.string(), nullable=False),
    pa.field("reference", pa.string()),
    pa.field("requested_at", pa.timestamp("us", tz="UTC")),
    pa.field("id", pa.string()),  # null: the request matched nothing (yet)
    pa.field("source", pa.string()),
    pa.field("via", pa.string(), nullable=False),
    # Who asked and through which door (`browser`, `cli`, `file`): the audit's "who".
    pa.field("requested_by", pa.string()),
    pa.field("door", pa.string()),
])
DOORS = ("browser", "cli", "file")


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


# A request file or folder: a local Path, or an `s3://` URI under an object-store root.
def opt_out_dir(storage: Storage | str | Path) -> Location:
    """The request folder under the storage root (a local folder or an `s3://` prefix)."""
    return as_storage(storage).opt_outs_dir


def request_files(directory: Location) -> list[Location]:
    """Request files in name order (hidden and temporary files are not requests); a folder
    that does not exist (no request yet; on S3, no object under the prefix) has none."""
    return [file for file in directory.files()
            if file.name.endswith(REQUEST_SUFFIXES) and not file.name.startswith(".")]


def fingerprint(location: Location) -> str:
    """Content hash: a rewritten file counts as new, a touched one does not."""
    return hashlib.sha256(location.read_bytes()).hexdigest()[:16]


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


def parse_file(location: Location) -> ParsedRequests:
    """Every valid request of a file, and every malformed row with its line number."""
    parsed = ParsedRequests()
    name = location.name
    try:
        text = location.read_bytes().decode("utf-8")
    except object_store.ObjectStoreError:
        raise  # the store itself is unusable: not a property of this one file
    except (OSError, UnicodeDecodeError) as exc:
        parsed.errors.append(RowError(name, 0, f"unreadable: {exc}"))
        return parsed
    rows = _csv_rows(text) if name.endswith(".csv") else _jsonl_rows(text)
    for line, record in rows:
        try:
            if isinstance(record, Exception):
                raise record
            parsed.requests.append(parse_request(record, name, line))
        except ValueError as exc:
            parsed.errors.append(RowError(name, line, str(exc)))
    return parsed


def parse_directory(directory: Location, names: Iterable[str] | None = None
                    ) -> ParsedRequests:
    """All request files of the folder (or only those named)."""
    wanted = set(names) if names is not None else None
    parsed = ParsedRequests()
    for location in request_files(directory):
        if wanted is None or location.name in wanted:
            parsed.extend(parse_file(location))
    return parsed


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


# --- resolution -------------------------------------------------------------------------

@dataclass
class _Keys:
    """Request values by key type, each mapped to the requests that named it."""

    by_type: dict[str, dict[str, list[OptOutRequest]]]

    @classmethod
    def of(cls, requests: Iterable[OptOutRequest], source: str) -> _Keys:
        by_type: dict[str, dict[str, list[OptOutRequest]]] = {k: {} for k in KEY_TYPES}
        for request in requests:
            if request.key_type == "id" and not request.value.startswith(f"{source}:"):
                continue
            if request.key_type == "source_key" and request.source not in (None, source):
                continue
            by_type[request.key_type].setdefault(request.value, []).append(request)
        return cls(by_type)

    def empty(self) -> bool:
        return not any(self.by_type.values())


def _scan(raw: TableRef, columns: list[str], batch_rows: int) -> Iterator[pa.RecordBatch]:
    table = raw.open()
    present = [c for c in columns if c in table.schema.names]
    yield from table.scanner(columns=present, batch_size=batch_rows).to_batches()


def _direct_matches(raw: TableRef, keys: _Keys, batch_rows: int
                    ) -> Iterator[tuple[OptOutRequest, str, str | None]]:
    """(request, id, sha256) for every raw_images row a request names directly."""
    for batch in _scan(raw, ["id", "sha256", "source_key", "url"], batch_rows):
        for key_type, values in keys.by_type.items():
            if not values or key_type not in batch.schema.names:
                continue
            hit = pc.is_in(batch.column(key_type), value_set=pa.array(list(values)))
            rows = batch.filter(pc.fill_null(hit, False))
            shas = rows.column("sha256").to_pylist() if "sha256" in rows.schema.names else None
            for i, (key, sample_id) in enumerate(zip(rows.column(key_type).to_pylist(),
                                                     rows.column("id").to_pylist(),
                                                     strict=True)):
                for request in values[key]:
                    yield request, sample_id, shas[i] if shas else None


def _same_bytes(raw: TableRef, shas: dict[str, set[str]], batch_rows: int
                ) -> Iterator[tuple[str, str]]:
    """(sha256, id) of rows whose bytes equal an opted-out image's."""
    if not shas:
        return
    for batch in _scan(raw, ["id", "sha256"], batch_rows):
        if "sha256" not in batch.schema.names:
            return
        hit = pc.fill_null(pc.is_in(batch.column("sha256"), value_set=pa.array(list(shas))),
                           False)
        rows = batch.filter(hit)
        yield from zip(rows.column("sha256").to_pylist(), rows.column("id").to_pylist(),
                       strict=True)


def _group_members(duplicates: TableRef, ids: set[str], batch_rows: int
                   ) -> dict[str, set[str]]:
    """For each id in a duplicate group, every other member of its group."""
    if not ids or not duplicates.exists():
        return {}
    table = duplicates.open()
    phash_of: dict[str, int] = {}
    for batch in table.scanner(columns=["id", "phash"], batch_size=batch_rows).to_batches():
        rows = batch.filter(pc.is_in(batch.column("id"), value_set=pa.array(list(ids))))
        phash_of.update(zip(rows.column("id").to_pylist(), rows.column("phash").to_pylist(),
                            strict=True))
    if not phash_of:
        return {}
    members: dict[int, set[str]] = {}
    wanted = pa.array(sorted(set(phash_of.values())), pa.int64())
    for batch in table.scanner(columns=["id", "phash"], batch_size=batch_rows).to_batches():
        rows = batch.filter(pc.is_in(batch.column("phash"), value_set=wanted))
        pairs = zip(rows.column("id").to_pylist(), rows.column("phash").to_pylist(),
                    strict=True)
        for sample_id, phash in pairs:
            members.setdefault(phash, set()).add(sample_id)
    return {i: members.get(p, set()) - {i} for i, p in phash_of.items()}


def resolve(requests: list[OptOutRequest], sources: list[str], storage: Storage | str | Path,
            batch_rows: int = 1 << 18) -> pa.Table:
    """The audit trail: one row per (request, id it removes), AUDIT_SCHEMA.

    A request that matches nothing keeps one row with a null id (`via = no_match`), so
    every request is accounted for.
    """
    storage = as_storage(storage)
    found: dict[str, dict[str, str]] = {}  # request_id -> id -> via
    shas: dict[str, set[str]] = {}  # sha256 -> request ids
    raw = {s: storage.table(RAW_IMAGES, s) for s in sources}
    raw = {s: table.pinned() for s, table in raw.items() if table.exists()}
    for source, table in raw.items():
        keys = _Keys.of(requests, source)
        if keys.empty():
            continue
        for request, sample_id, sha in _direct_matches(table, keys, batch_rows):
            found.setdefault(request.request_id, {})[sample_id] = VIA_DIRECT
            if sha:
                shas.setdefault(sha, set()).add(request.request_id)
    for table in raw.values():
        for sha, sample_id in _same_bytes(table, shas, batch_rows):
            for request_id in shas[sha]:
                found[request_id].setdefault(sample_id, VIA_SAME_BYTES)
    direct = {i for ids in found.values() for i in ids}
    members = _group_members(storage.table(DUPLICATES), direct, batch_rows)
    for ids in found.values():
        for sample_id in list(ids):
            for other in members.get(sample_id, ()):
                ids.setdefault(other, VIA_DUPLICATE)
    return _audit_table(requests, found)


def _audit_table(requests: list[OptOutRequest], found: dict[str, dict[str, str]]) -> pa.Table:
    rows = []
    for request in requests:
        # (id, via) per match; no match is one row with no id
        matches: list[tuple[str | None, str]] = (
            list((found.get(request.request_id) or {}).items()) or [(None, VIA_NO_MATCH)])
        for sample_id, via in sorted(matches, key=lambda kv: str(kv[0])):
            rows.append({
                "request_id": request.request_id, "file": request.file, "line": request.line,
                "key_type": request.key_type, "value": request.value,
                "reference": request.reference, "requested_at": request.requested_at,
                "id": sample_id, "source": sample_id.split(":", 1)[0] if sample_id else None,
                "via": via, "requested_by": request.requested_by, "door": request.door})
    return pa.Table.from_pylist(rows, schema=AUDIT_SCHEMA)


def affected_sources(audit: pa.Table) -> list[str]:
    return sorted(s for s in set(audit.column("source").to_pylist()) if s)


def ids_for_source(audit: pa.Table, source: str) -> set[str]:
    rows = audit.filter(pc.equal(audit.column("source"), source))
    return set(rows.column("id").to_pylist())
