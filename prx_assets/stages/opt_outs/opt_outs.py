"""Opt-out matching: requests resolved to the ids they remove (the audit rows).

Resolution scans only the key columns of each source's raw_images, in bounded batches,
and extends every match to its exact copies elsewhere: the same bytes (sha256) in any
source, and every member of its phash group in the duplicates table. Each request is
resolved on its own (its rows depend on it and the input tables only), so the rows of
some requests resolved now and those of others resolved earlier against the same table
versions make one audit. Readers do not call `resolve`: they go through
`resolution.resolve_opt_outs` (see the package docstring).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from prx_assets.stages.opt_outs.requests import KEY_TYPES, OptOutRequest
from prx_assets.storage.layout import Storage, as_storage
from prx_assets.storage.refs import TableRef
from prx_assets.storage.tables import DUPLICATES, RAW_IMAGES

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


@dataclass(frozen=True)
class ResolutionInputs:
    """The tables a resolution reads, each pinned at one version."""

    raw_images: dict[str, TableRef]  # source -> its raw_images (sources with one only)
    duplicates: TableRef | None  # None: no duplicates table yet

    @classmethod
    def pin(cls, storage: Storage | str | Path, sources: Iterable[str]) -> ResolutionInputs:
        storage = as_storage(storage)
        raw = {s: storage.table(RAW_IMAGES, s) for s in sorted(sources)}
        raw = {s: table.at(version) for s, table in raw.items()
               if (version := table.latest_version()) is not None}
        duplicates = storage.table(DUPLICATES)
        version = duplicates.latest_version()
        return cls(raw, None if version is None else duplicates.at(version))

    def versions(self) -> dict[str, int | None]:
        """`raw_images/<source>` and `duplicates` -> the version read: equal versions,
        equal resolutions."""
        found: dict[str, int | None] = {f"{RAW_IMAGES}/{s}": t.version
                                        for s, t in self.raw_images.items()}
        found[DUPLICATES] = self.duplicates.version if self.duplicates else None
        return found


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


def _group_members(duplicates: TableRef | None, ids: set[str], batch_rows: int
                   ) -> dict[str, set[str]]:
    """For each id in a duplicate group, every other member of its group."""
    if not ids or duplicates is None:
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


def resolve(requests: list[OptOutRequest], inputs: ResolutionInputs,
            batch_rows: int = 1 << 18) -> pa.Table:
    """The audit rows of `requests`: one row per (request, id it removes), AUDIT_SCHEMA.

    A request that matches nothing keeps one row with a null id (`via = no_match`), so
    every request is accounted for.
    """
    found: dict[str, dict[str, str]] = {}  # request_id -> id -> via
    shas: dict[str, set[str]] = {}  # sha256 -> request ids
    for source, table in inputs.raw_images.items():
        keys = _Keys.of(requests, source)
        if keys.empty():
            continue
        for request, sample_id, sha in _direct_matches(table, keys, batch_rows):
            found.setdefault(request.request_id, {})[sample_id] = VIA_DIRECT
            if sha:
                shas.setdefault(sha, set()).add(request.request_id)
    for table in inputs.raw_images.values():
        for sha, sample_id in _same_bytes(table, shas, batch_rows):
            for request_id in shas[sha]:
                found[request_id].setdefault(sample_id, VIA_SAME_BYTES)
    direct = {i for ids in found.values() for i in ids}
    members = _group_members(inputs.duplicates, direct, batch_rows)
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
