"""The attribute record: a versioned JSON schema shipped in the package, its typed Lance
columns, a validator driven by the schema itself, and the rows the table holds.

The JSON schema (`schemas/attributes_<version>.json`) is what a model's output is
constrained to and checked against; the Lance table holds one typed column per field (enum
fields as strings, `subjects` as a list of strings, `watermark` a boolean, the qualities
small integers), never a JSON string, so search, the browser and subsets filter on them.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import resources
from typing import Any

import pyarrow as pa

SCHEMA_VERSION = "v1"

STATUS_OK = "ok"  # a record that validates
STATUS_INVALID = "invalid"  # the model's answer never validated: recorded with the reason
STATUS_FAILED = "failed"  # inference failed (an engine error): retried on the next run
FINAL_STATUSES = (STATUS_OK, STATUS_INVALID)

# The word conditions (`--where`, subsets) and facets use for a null value: the record
# does not know it (a withheld field, or a quality a caption cannot tell), which is not "no".
UNKNOWN = "unknown"

ORIGIN_MODEL = "model"  # a VLM looked at the image under structured decoding
ORIGIN_CAPTION = "caption_derived"  # derived from the caption text alone (the CPU default)


@functools.cache
def json_schema(version: str = SCHEMA_VERSION) -> dict[str, Any]:
    """The shipped JSON schema of `version`."""
    path = resources.files("prx_assets.stages.attributes").joinpath(
        "schemas", f"attributes_{version}.json")
    if not path.is_file():
        raise FileNotFoundError(f"no attribute schema {version!r} (looked for {path})")
    return json.loads(path.read_text(encoding="utf-8"))


def schema_text(version: str = SCHEMA_VERSION) -> str:
    """The schema as canonical JSON: what a version hash and a prompt are made of."""
    return json.dumps(json_schema(version), sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class Field:
    """One attribute: its name, JSON type and allowed values (enum or integer range)."""

    name: str
    kind: str  # "enum", "enum_list", "boolean", "integer"
    values: tuple[Any, ...] = ()  # the choices (enum, enum_list, boolean, integer range)
    min_items: int = 0
    max_items: int = 0

    @property
    def arrow_type(self) -> pa.DataType:
        return {"enum": pa.string(), "enum_list": pa.list_(pa.string()),
                "boolean": pa.bool_(), "integer": pa.int8()}[self.kind]


def _field(name: str, spec: Mapping[str, Any]) -> Field:
    kind = spec["type"]
    if kind == "string":
        return Field(name, "enum", tuple(spec["enum"]))
    if kind == "array":
        return Field(name, "enum_list", tuple(spec["items"]["enum"]),
                     spec.get("minItems", 0), spec.get("maxItems", len(spec["items"]["enum"])))
    if kind == "boolean":
        return Field(name, "boolean", (False, True))
    if kind == "integer":
        return Field(name, "integer", tuple(range(spec["minimum"], spec["maximum"] + 1)))
    raise ValueError(f"attribute {name!r}: type {kind!r} has no column type")


@functools.cache
def fields(version: str = SCHEMA_VERSION) -> tuple[Field, ...]:
    """The schema's attributes, in the order it lists them (the order a model writes them)."""
    schema = json_schema(version)
    return tuple(_field(name, spec) for name, spec in schema["properties"].items())


def field_named(name: str, version: str = SCHEMA_VERSION) -> Field:
    for f in fields(version):
        if f.name == name:
            return f
    raise KeyError(f"no attribute {name!r} in schema {version}; "
                   f"one of {[f.name for f in fields(version)]}")


def attributes_schema(version: str = SCHEMA_VERSION) -> pa.Schema:
    """The Lance table: keys and provenance, then one typed, nullable column per attribute
    (a caption-derived record leaves out what a caption cannot tell, e.g. the qualities)."""
    return pa.schema([
        pa.field("id", pa.string(), nullable=False),
        pa.field("caption_version", pa.string(), nullable=False),
        pa.field("attribute_version", pa.string(), nullable=False),
        pa.field("origin", pa.string(), nullable=False),
        pa.field("status", pa.string(), nullable=False),
        pa.field("error", pa.string()),
        pa.field("attempts", pa.int16()),
        *(pa.field(f.name, f.arrow_type) for f in fields(version)),
        pa.field("created_at", pa.timestamp("us", tz="UTC")),
        # Which fields the backend leaves null on purpose, and why (last: added to older
        # tables by `ensure`, which appends).
        pa.field("withheld", pa.string()),
    ])


def validate(record: Any, version: str = SCHEMA_VERSION, partial: bool = False) -> list[str]:
    """Every way `record` breaks the schema (empty: valid). `partial` accepts missing
    fields (a caption-derived record) but nothing outside the schema."""
    if not isinstance(record, dict):
        return [f"not an object: {type(record).__name__}"]
    known = {f.name: f for f in fields(version)}
    errors = [f"unknown field {name!r}" for name in record if name not in known]
    for name, f in known.items():
        if name not in record or record[name] is None:
            if not partial:
                errors.append(f"missing {name!r}")
            continue
        errors += _field_errors(f, record[name])
    return errors


def _field_errors(f: Field, value: Any) -> list[str]:
    if f.kind == "enum":
        return [] if isinstance(value, str) and value in f.values else \
            [f"{f.name}: {value!r} is not one of {list(f.values)}"]
    if f.kind == "boolean":
        return [] if isinstance(value, bool) else [f"{f.name}: {value!r} is not a boolean"]
    if f.kind == "integer":
        ok = isinstance(value, int) and not isinstance(value, bool) and value in f.values
        return [] if ok else [f"{f.name}: {value!r} is not an integer in "
                              f"{f.values[0]}..{f.values[-1]}"]
    if not isinstance(value, list):
        return [f"{f.name}: {value!r} is not a list"]
    errors = [f"{f.name}: {v!r} is not one of {list(f.values)}" for v in value
              if v not in f.values]
    if not f.min_items <= len(value) <= f.max_items:
        errors.append(f"{f.name}: {len(value)} items, not {f.min_items}..{f.max_items}")
    if len(set(map(str, value))) != len(value):
        errors.append(f"{f.name}: repeated items")
    return errors


def parse_record(text: str | None, version: str = SCHEMA_VERSION
                 ) -> tuple[dict[str, Any] | None, str | None]:
    """A model's answer as a valid record, or None and the reason it is not one."""
    if not text or not text.strip():
        return None, "empty answer"
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        return None, f"not JSON: {exc.msg} at {exc.pos}"
    errors = validate(record, version)
    return (record, None) if not errors else (None, "; ".join(errors)[:500])


@dataclass(frozen=True)
class Tagged:
    """One image's outcome: a record (or None) and how it was reached."""

    id: str
    caption_version: str
    record: dict[str, Any] | None
    status: str
    origin: str
    error: str | None = None
    attempts: int = 1
    withheld: str | None = None  # fields left null on purpose, and why


def attribute_rows(tagged: Sequence[Tagged], attribute_version: str,
                   version: str = SCHEMA_VERSION) -> pa.Table:
    """Rows of `attributes_schema`: one typed column per attribute, null where unknown."""
    now = datetime.now(UTC)
    schema = attributes_schema(version)
    columns: dict[str, list[Any]] = {
        "id": [t.id for t in tagged],
        "caption_version": [t.caption_version for t in tagged],
        "attribute_version": [attribute_version] * len(tagged),
        "origin": [t.origin for t in tagged],
        "status": [t.status for t in tagged],
        "error": [t.error for t in tagged],
        "attempts": [t.attempts for t in tagged],
        "created_at": [now] * len(tagged),
        "withheld": [t.withheld for t in tagged],
    }
    for f in fields(version):
        columns[f.name] = [(t.record or {}).get(f.name) for t in tagged]
    return pa.Table.from_pydict(columns, schema=schema)
