"""The sources file: which image collections feed the corpus, validated on load.

Each source becomes one Dagster partition, so a bad entry must fail loudly at load time
with the source and the field named, never later inside a run.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

SOURCE_KINDS = ("image_folder", "webdataset", "parquet", "lance")
NAME_PATTERN = re.compile(r"^[a-z0-9_]+$")
DEFAULT_SOURCES_FILE = "sources.yaml"

# Fields every kind accepts, and the extra fields each kind understands.
_COMMON_FIELDS = {"name", "kind", "uri", "license", "weight", "description"}
_KIND_FIELDS: dict[str, set[str]] = {
    "image_folder": {"caption_suffix"},
    "webdataset": {"image_extensions", "caption_extension", "caption_field", "url_field",
                   "provenance"},
    "parquet": {"image_column", "image_is_path", "key_column", "caption_column", "url_column",
                "provenance"},
    "lance": {"image_column", "key_column", "caption_column", "url_column", "provenance"},
}
# Per-sample provenance and rights fields, read from a WebDataset sample's `.json` keys or
# a Parquet/Lance row's columns: each field's default names, first found wins. A source's
# `provenance:` mapping names its own key or column for a field (docs/rights.md).
PROVENANCE_FIELDS: dict[str, tuple[str, ...]] = {
    "license": ("license",),
    "license_url": ("license_url",),
    "attribution": ("attribution", "author", "creator"),
    "x_robots_tag": ("x_robots_tag", "x-robots-tag", "X-Robots-Tag"),
    "tdm_reservation": ("tdm_reservation", "tdm-reservation"),
    "tdm_policy": ("tdm_policy", "tdm-policy"),
}


class SourcesError(ValueError):
    """The sources file is missing or malformed; the message names the source and field."""


@dataclass(frozen=True)
class SourceSpec:
    """One configured source collection (one partition of every per-source asset)."""

    name: str
    kind: str
    uri: str
    license: str = "unknown"
    weight: float = 1.0
    description: str = ""
    # image_folder: a sibling text file holding the caption (`a.jpg` -> `a.txt`).
    caption_suffix: str = ".txt"
    # webdataset: member extensions that hold the image, and where the caption lives.
    image_extensions: tuple[str, ...] = ("jpg", "jpeg", "png", "webp")
    caption_extension: str = "txt"
    caption_field: str = "caption"
    # webdataset: the field of the sample's .json holding its url (kept for opt-outs by url).
    url_field: str = "url"
    # parquet / lance: column names.
    image_column: str = "image"
    image_is_path: bool = False
    key_column: str | None = None
    caption_column: str | None = None
    url_column: str | None = None
    # webdataset / parquet / lance: provenance field -> the source's key or column for it
    # (PROVENANCE_FIELDS' names where a field is not named here).
    provenance: tuple[tuple[str, str], ...] = ()

    def provenance_names(self) -> dict[str, tuple[str, ...]]:
        """Each provenance field's candidate keys or columns, the source's own first."""
        named = dict(self.provenance)
        return {f: ((named[f],) if f in named else names) for f, names
                in PROVENANCE_FIELDS.items()}

    @property
    def in_object_store(self) -> bool:
        return "://" in self.uri and not self.uri.startswith("file://")

    def resolved_location(self, base_dir: Path) -> str:
        """The uri as a location string: an object-store URI as given, else an absolute
        local path (relative uris are relative to the sources file)."""
        return self.uri.rstrip("/") if self.in_object_store else str(self.resolved_uri(base_dir))

    def resolved_uri(self, base_dir: Path) -> Path:
        """The uri as an absolute path; relative uris are relative to the sources file."""
        path = Path(os.path.expanduser(self.uri))
        return path if path.is_absolute() else (base_dir / path).resolve()


@dataclass(frozen=True)
class SourcesConfig:
    """All sources, in file order (the order breaks dedup ties)."""

    sources: tuple[SourceSpec, ...]
    base_dir: Path = field(default_factory=Path.cwd)

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.sources]

    def get(self, name: str) -> SourceSpec:
        for spec in self.sources:
            if spec.name == name:
                return spec
        raise SourcesError(f"unknown source {name!r}; configured: {', '.join(self.names)}")

    def uri_of(self, name: str) -> Path:
        return self.get(name).resolved_uri(self.base_dir)

    def location_of(self, name: str) -> str:
        """Where the source lives: an absolute local path or an `s3://` URI."""
        return self.get(name).resolved_location(self.base_dir)


def sources_path() -> Path:
    return Path(os.environ.get("PRX_SOURCES", DEFAULT_SOURCES_FILE)).resolve()


def load_sources(path: str | Path | None = None) -> SourcesConfig:
    """Read and validate a sources file (default: `$PRX_SOURCES` or `./sources.yaml`)."""
    path = Path(path) if path is not None else sources_path()
    if not path.is_file():
        raise SourcesError(f"sources file not found: {path} (set PRX_SOURCES or create it)")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise SourcesError(f"{path}: not valid YAML: {exc}") from exc
    if isinstance(raw, Mapping) and "sources" in raw:
        raw = raw["sources"]
    if not isinstance(raw, list) or not raw:
        raise SourcesError(f"{path}: expected a non-empty list of sources (or a 'sources:' key)")
    specs = tuple(parse_source(entry, index, path) for index, entry in enumerate(raw))
    _reject_duplicate_names(specs, path)
    return SourcesConfig(sources=specs, base_dir=path.parent.resolve())


def parse_source(entry: Any, index: int, path: Path | str = "<sources>") -> SourceSpec:
    """Validate one entry; errors read `<file>: source #i 'name': field 'x': problem`."""
    label = f"{path}: source #{index + 1}"
    if not isinstance(entry, Mapping):
        raise SourcesError(f"{label}: expected a mapping, got {type(entry).__name__}")
    name = entry.get("name")
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise SourcesError(f"{label}: field 'name': {name!r} must match [a-z0-9_]+")
    label = f"{label} {name!r}"

    def fail(field_name: str, problem: str) -> SourcesError:
        return SourcesError(f"{label}: field '{field_name}': {problem}")

    kind = entry.get("kind")
    if kind not in SOURCE_KINDS:
        raise fail("kind", f"{kind!r} is not one of {', '.join(SOURCE_KINDS)}")
    uri = entry.get("uri")
    if not isinstance(uri, str) or not uri.strip():
        raise fail("uri", "required, a path or s3:// URI of the source")
    unknown = set(entry) - _COMMON_FIELDS - _KIND_FIELDS[kind]
    if unknown:
        raise fail(sorted(unknown)[0], f"not a field of kind {kind!r}")
    weight = entry.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight < 0:
        raise fail("weight", f"{weight!r} must be a number >= 0")

    kwargs: dict[str, Any] = {"name": name, "kind": kind, "uri": uri, "weight": float(weight)}
    for key in ("license", "description", "caption_suffix", "caption_extension", "caption_field",
                "image_column", "key_column", "caption_column", "url_field", "url_column"):
        if key in entry:
            value = entry[key]
            if not isinstance(value, str) or not value:
                raise fail(key, f"{value!r} must be a non-empty string")
            kwargs[key] = value
    if "image_is_path" in entry:
        if not isinstance(entry["image_is_path"], bool):
            raise fail("image_is_path", "must be true or false")
        kwargs["image_is_path"] = entry["image_is_path"]
    if "image_extensions" in entry:
        exts = entry["image_extensions"]
        if not isinstance(exts, list) or not exts or not all(isinstance(e, str) for e in exts):
            raise fail("image_extensions", "must be a non-empty list of extensions")
        kwargs["image_extensions"] = tuple(e.lower().lstrip(".") for e in exts)
    if "provenance" in entry:
        kwargs["provenance"] = _provenance(entry["provenance"], fail)
    if kind == "lance" and "key_column" not in entry:
        raise fail("key_column", "required for kind 'lance' (ids derive from a stable key)")
    return SourceSpec(**kwargs)


def _provenance(mapping: Any, fail: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(mapping, Mapping):
        raise fail("provenance", "must map fields to the source's keys or columns")
    for key, value in mapping.items():
        if key not in PROVENANCE_FIELDS:
            raise fail("provenance", f"{key!r} is not one of {', '.join(PROVENANCE_FIELDS)}")
        if not isinstance(value, str) or not value:
            raise fail("provenance", f"{key}: {value!r} must be a non-empty string")
    return tuple(sorted((str(k), str(v)) for k, v in mapping.items()))


def _reject_duplicate_names(specs: tuple[SourceSpec, ...], path: Path) -> None:
    seen: set[str] = set()
    for index, spec in enumerate(specs):
        if spec.name in seen:
            raise SourcesError(
                f"{path}: source #{index + 1} {spec.name!r}: field 'name': duplicate source name"
            )
        seen.add(spec.name)
