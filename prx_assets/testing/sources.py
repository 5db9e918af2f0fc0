"""A sources file for tests: one YAML flow mapping per source."""

from __future__ import annotations

from pathlib import Path


def write_sources(path: Path, entries: list[str]) -> Path:
    """`entries`: each source as a flow mapping, e.g. `{name: web, kind: image_folder, uri: /x}`."""
    path.write_text("sources:\n" + "".join(f"  - {e}\n" for e in entries))
    return path


def folder_source(name: str, folder: Path | str) -> str:
    """The entry of an image-folder source."""
    return f"{{name: {name}, kind: image_folder, uri: {folder}}}"
