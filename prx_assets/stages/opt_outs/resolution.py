"""The one opt-out resolver: `resolve_opt_outs`, the audited table first, the rest on the fly.

The `opt_outs` table records, with its rows, what they resolve (in its schema's metadata,
RECORD_KEY): the fingerprint of every request file resolved, the malformed rows found in
them, and the version of every input table (`ResolutionInputs.versions`). A request file
whose fingerprint is recorded, in a table resolved against the input versions of now, is
read from the table; every other file (dropped, rewritten or written by a door after the
table's resolution) is parsed and resolved here, now. So a reader gets every request of
the folder, resolved against the inputs of now, and never misses one the table lacks: it
fails closed without parsing what was already resolved.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from prx_assets.stages.opt_outs.opt_outs import AUDIT_SCHEMA, ResolutionInputs, resolve
from prx_assets.stages.opt_outs.requests import RowError, parse_files, read_request_files
from prx_assets.storage.layout import Storage, as_storage
from prx_assets.storage.tables import OPT_OUTS, RAW_IMAGES

RECORD_KEY = b"prx.opt_outs.resolution"


@dataclass(frozen=True)
class Record:
    """What a resolution covered: request file -> fingerprint, the malformed rows of those
    files, and the input table versions it read."""

    files: dict[str, str] = field(default_factory=dict)
    errors: list[RowError] = field(default_factory=list)
    inputs: dict[str, int | None] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({"files": self.files, "inputs": self.inputs,
                           "errors": [[e.file, e.line, e.message] for e in self.errors]},
                          sort_keys=True)

    @classmethod
    def from_schema(cls, schema: pa.Schema) -> Record | None:
        text = (schema.metadata or {}).get(RECORD_KEY)
        if text is None:
            return None  # a table written before the record existed: nothing is reused
        data = json.loads(text)
        return cls(data["files"], [RowError(*e) for e in data["errors"]], data["inputs"])


@dataclass(frozen=True)
class Resolution:
    """Every request of the folder now, resolved: `audit` (AUDIT_SCHEMA rows, in file and
    line order), the malformed rows, and which files this call resolved itself."""

    audit: pa.Table
    record: Record
    resolved_now: tuple[str, ...]  # files not taken from the table

    @property
    def errors(self) -> list[RowError]:
        return self.record.errors

    @property
    def requests(self) -> int:
        return len(set(self.audit.column("request_id").to_pylist()))

    @property
    def schema(self) -> pa.Schema:
        """AUDIT_SCHEMA carrying this record: the schema to write the `opt_outs` table with."""
        return AUDIT_SCHEMA.with_metadata({RECORD_KEY: self.record.to_json()})

    def of_files(self, names: Iterable[str]) -> pa.Table:
        """The audit rows of the requests in these files."""
        return self.audit.filter(pc.is_in(self.audit.column("file"),
                                          value_set=pa.array(sorted(names), pa.string())))


def resolve_opt_outs(storage: Storage | str | Path, sources: Iterable[str] | None = None,
                     batch_rows: int = 1 << 18) -> Resolution:
    """Every request in `Storage.opt_outs_dir` resolved to the ids it removes: the
    `opt_outs` table's rows where it resolved the same file against the same inputs, the
    other files parsed and resolved now. `sources`: those whose raw_images resolve the
    requests (default: every source with a raw_images table, so that a copy of an image
    opted out elsewhere is found too)."""
    storage = as_storage(storage)
    files = read_request_files(storage.opt_outs_dir)
    if not files:
        return Resolution(AUDIT_SCHEMA.empty_table(), Record(), ())
    names = sorted(sources) if sources is not None else ingested_sources(storage)
    inputs = ResolutionInputs.pin(storage, names)
    table_rows, recorded = recorded_resolution(storage)
    if recorded is None or recorded.inputs != inputs.versions():
        recorded = Record()
    current = {f.name: f.fingerprint for f in files if f.data is not None}  # unreadable: fresh
    kept = {name for name, stamp in current.items() if recorded.files.get(name) == stamp}
    fresh = [f for f in files if f.name not in kept]
    parsed = parse_files(fresh)
    rows = [table_rows.filter(pc.is_in(table_rows.column("file"),
                                       value_set=pa.array(sorted(kept), pa.string())))]
    if parsed.requests:
        rows.append(resolve(parsed.requests, inputs, batch_rows))
    audit = pa.concat_tables(rows).sort_by([("file", "ascending"), ("line", "ascending"),
                                            ("id", "ascending")])
    errors = [e for e in recorded.errors if e.file in kept] + parsed.errors
    record = Record(current, sorted(errors, key=lambda e: (e.file, e.line)),
                    inputs.versions())
    return Resolution(audit, record, tuple(sorted(f.name for f in fresh)))


def recorded_resolution(storage: Storage) -> tuple[pa.Table, Record | None]:
    """The `opt_outs` table's rows and record, read at one version (no table: no rows)."""
    table = storage.table(OPT_OUTS)
    version = table.latest_version()
    if version is None:
        return AUDIT_SCHEMA.empty_table(), None
    dataset = table.at(version).open()
    record = Record.from_schema(dataset.schema)
    if record is None:
        return AUDIT_SCHEMA.empty_table(), None
    return dataset.to_table().cast(AUDIT_SCHEMA), record


def ingested_sources(storage: Storage) -> list[str]:
    """Sources with a raw_images table (`lance/raw_images/<source>.lance`)."""
    return [name.removesuffix(".lance") for name in storage.table_folder(RAW_IMAGES).folders()
            if name.endswith(".lance")]
