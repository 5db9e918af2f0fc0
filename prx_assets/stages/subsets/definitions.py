"""The subsets file (`subsets.yaml`, `$PRX_SUBSETS` overrides): named, versioned subset
definitions, validated on load (each subset is a Dagster partition, so a bad entry fails at
load time with the subset and the field named).

    subsets:
      - name: clean_photos          # [a-z0-9_]+, the partition key
        version: 1                  # bump by hand when the intent changes
        description: ...
        sources: [demo_folder]      # optional: default every source
        tiers: [512]                # optional
        labels: [visual]            # optional: caption labels kept
        attributes:                 # optional: per field, the values kept
          medium: [photo]           #   enum: any of these values
          subjects: [animal, food]  #   list: shares at least one
          watermark: false          #   boolean
          visible_text: [none, unknown]  # `unknown`: the record does not know (null)
          aesthetic_quality: {min: 3}  # integer range (min and/or max)
        caption_derived: true       # optional: accept caption-derived records (default true)
        concepts: {level: 1, clusters: [0, 3]}  # optional: only these concept clusters
        cap_per_source: 1000        # optional
        cap_per_cluster: 50         # optional: per concept cluster at `concept_level`
        concept_level: 1
        target_size: 2000           # optional: at most this many samples
        seed: 0                     # which samples a cap or the target keeps
        weight: 1.0                 # the loader's default weight when mixed

The definition's version (`fingerprint`) is a hash of all of it, so lineage names exactly
which definition a tree was built from.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from prx_assets.stages.attributes.schema import SCHEMA_VERSION, UNKNOWN, field_named

DEFAULT_SUBSETS_FILE = "subsets.yaml"
NAME_PATTERN = re.compile(r"^[a-z0-9_]+$")
_KEYS = {"name", "version", "description", "sources", "tiers", "labels", "attributes",
         "caption_derived", "concepts", "cap_per_source", "cap_per_cluster", "concept_level",
         "target_size", "seed", "weight"}


class SubsetsError(ValueError):
    """The subsets file is missing or malformed; the message names the subset and field."""


@dataclass(frozen=True)
class AttributeCondition:
    """One attribute's condition: allowed values (enum, list, boolean) or a range."""

    field: str
    values: tuple[Any, ...] = ()
    minimum: int | None = None
    maximum: int | None = None


@dataclass(frozen=True)
class SubsetDefinition:
    name: str
    version: int = 1
    description: str = ""
    sources: tuple[str, ...] = ()  # empty: every source
    tiers: tuple[int, ...] = ()
    labels: tuple[str, ...] = ()
    attributes: tuple[AttributeCondition, ...] = ()
    caption_derived: bool = True
    concept_level: int = 1
    concept_clusters: tuple[int, ...] = ()
    cap_per_source: int | None = None
    cap_per_cluster: int | None = None
    target_size: int | None = None
    seed: int = 0
    weight: float = 1.0
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def needs_concepts(self) -> bool:
        return bool(self.concept_clusters) or self.cap_per_cluster is not None

    def fingerprint(self) -> str:
        """`<version>-<12 hex>`: the definition as written, hashed."""
        blob = json.dumps(self.raw, sort_keys=True, default=str).encode()
        return f"{self.version}-{hashlib.sha256(blob).hexdigest()[:12]}"


@dataclass(frozen=True)
class SubsetsConfig:
    subsets: tuple[SubsetDefinition, ...]
    path: Path | None = None

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.subsets]

    def get(self, name: str) -> SubsetDefinition:
        for subset in self.subsets:
            if subset.name == name:
                return subset
        raise KeyError(f"no subset named {name!r} in {self.path}; subsets: {self.names}")


def subsets_path() -> Path:
    return Path(os.environ.get("PRX_SUBSETS", DEFAULT_SUBSETS_FILE)).resolve()


def load_subsets(path: str | Path | None = None, missing_ok: bool = True) -> SubsetsConfig:
    """Read and validate a subsets file (default `$PRX_SUBSETS` or `./subsets.yaml`); a
    missing file is no subsets (unless `missing_ok` is False)."""
    path = Path(path) if path is not None else subsets_path()
    if not path.is_file():
        if missing_ok:
            return SubsetsConfig((), path)
        raise SubsetsError(f"subsets file not found: {path} (set PRX_SUBSETS or create it)")
    raw = yaml.safe_load(path.read_text()) or {}
    entries = raw.get("subsets") if isinstance(raw, dict) else None
    if not isinstance(entries, list):
        raise SubsetsError(f"{path}: expected a top-level `subsets:` list")
    subsets = tuple(parse_subset(entry, path) for entry in entries)
    names = [s.name for s in subsets]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise SubsetsError(f"{path}: subset names repeated: {repeated}")
    return SubsetsConfig(subsets, path)


def parse_subset(entry: Any, path: Path | str = "subsets.yaml") -> SubsetDefinition:
    if not isinstance(entry, dict):
        raise SubsetsError(f"{path}: each subset is a mapping, got {entry!r}")
    name = entry.get("name")

    def fail(key: str, why: str) -> SubsetsError:
        return SubsetsError(f"{path}: subset {name!r}, field {key!r}: {why}")

    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise fail("name", "must match [a-z0-9_]+")
    unknown = sorted(set(entry) - _KEYS)
    if unknown:
        raise fail(unknown[0], f"unknown field; known: {sorted(_KEYS)}")
    concepts = entry.get("concepts") or {}
    if not isinstance(concepts, dict):
        raise fail("concepts", "expected {level: N, clusters: [...]}")
    return SubsetDefinition(
        name=name, version=_int(entry.get("version", 1), fail, "version", 1),
        description=str(entry.get("description", "")),
        sources=_strings(entry.get("sources"), fail, "sources"),
        tiers=tuple(_int(t, fail, "tiers", 1) for t in _list(entry.get("tiers"), fail, "tiers")),
        labels=_strings(entry.get("labels"), fail, "labels"),
        attributes=_conditions(entry.get("attributes") or {}, fail),
        caption_derived=bool(entry.get("caption_derived", True)),
        concept_level=_int(concepts.get("level", entry.get("concept_level", 1)), fail,
                           "concept_level", 1),
        concept_clusters=tuple(_int(c, fail, "concepts", 0)
                               for c in _list(concepts.get("clusters"), fail, "concepts")),
        cap_per_source=_optional_int(entry.get("cap_per_source"), fail, "cap_per_source"),
        cap_per_cluster=_optional_int(entry.get("cap_per_cluster"), fail, "cap_per_cluster"),
        target_size=_optional_int(entry.get("target_size"), fail, "target_size"),
        seed=_int(entry.get("seed", 0), fail, "seed", 0),
        weight=float(entry.get("weight", 1.0)),
        raw=dict(entry))


def _list(value: Any, fail, key: str) -> list:
    if value is None:
        return []
    if not isinstance(value, list):
        raise fail(key, f"expected a list, got {value!r}")
    return value


def _strings(value: Any, fail, key: str) -> tuple[str, ...]:
    return tuple(str(v) for v in _list(value, fail, key))


def _int(value: Any, fail, key: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise fail(key, f"{value!r} must be an integer >= {minimum}")
    return value


def _optional_int(value: Any, fail, key: str) -> int | None:
    return None if value is None else _int(value, fail, key, 1)


def _conditions(spec: Any, fail, version: str = SCHEMA_VERSION
                ) -> tuple[AttributeCondition, ...]:
    if not isinstance(spec, dict):
        raise fail("attributes", "expected a mapping of attribute -> condition")
    conditions = []
    for name, condition in spec.items():
        try:
            f = field_named(name, version)
        except KeyError as exc:
            raise fail("attributes", str(exc.args[0])) from None
        if f.kind == "integer":
            if isinstance(condition, int) and not isinstance(condition, bool):
                condition = {"min": condition, "max": condition}
            if not isinstance(condition, dict) or not set(condition) <= {"min", "max"}:
                raise fail(f"attributes.{name}", "expected {min: N, max: N}")
            conditions.append(AttributeCondition(name, minimum=condition.get("min"),
                                                 maximum=condition.get("max")))
            continue
        values = condition if isinstance(condition, list) else [condition]
        bad = [v for v in values if v not in (*f.values, UNKNOWN)]
        if bad or not values:
            raise fail(f"attributes.{name}",
                       f"{bad or values!r}: allowed {[*f.values, UNKNOWN]}")
        conditions.append(AttributeCondition(name, tuple(values)))
    return tuple(conditions)
