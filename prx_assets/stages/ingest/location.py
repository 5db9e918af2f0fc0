"""Where a source lives: a local folder or file, or an object-store prefix (`s3://...`),
opened through `pyarrow.fs` so every reader streams from either the same way.

A location is resolved on the driver (the standard AWS variables and any overrides become
explicit settings, see `storage.object_store.StoreSettings`) and pickled into Ray tasks, which
build their file system from those settings, never from their own environment.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import pyarrow.fs as pafs

from prx_assets.storage import object_store
from prx_assets.storage.object_store import StoreSettings
from prx_assets.storage.refs import TableRef


@dataclass(frozen=True)
class SourceLocation:
    """A source's `uri` (an absolute local path, or `s3://bucket/prefix`), the resolved
    object-store settings (None locally), and whether it names one file (a single tar or
    parquet file) rather than a folder or prefix."""

    uri: str
    settings: StoreSettings | None = field(default=None, repr=False)
    single_file: bool = False

    @classmethod
    def of(cls, uri: str | Path, overrides: Mapping[str, str] | None = None
           ) -> SourceLocation:
        text = object_store.as_uri(uri)
        if object_store.is_object_store(text):
            return cls(text.rstrip("/"), StoreSettings.resolve(text, overrides))
        return cls(str(Path(text.removeprefix("file://")).expanduser().absolute()))

    @property
    def is_local(self) -> bool:
        return self.settings is None

    def table(self, version: int | None = None) -> TableRef:
        """The source as a Lance table (a source of kind `lance`)."""
        return TableRef(self.uri, version, self.settings)

    @property
    def base(self) -> str:
        """The location as the file system names it (`bucket/prefix` on S3)."""
        return self.uri if self.is_local else self.uri.partition("://")[2]

    def filesystem(self) -> pafs.FileSystem:
        return object_store.s3_filesystem(self.settings) if self.settings \
            else pafs.LocalFileSystem()

    def path_of(self, rel: str) -> str:
        """The file system path of a unit (a path relative to the location)."""
        return self.base if self.single_file else f"{self.base.rstrip('/')}/{rel}"

    def as_single_file(self) -> SourceLocation:
        return replace(self, single_file=True)

    def check_reachable(self) -> None:
        """On an object store, fail at once naming the URI and the cause."""
        if self.settings:
            object_store.check_reachable(self.uri, self.settings)

    def info(self, path: str | None = None) -> pafs.FileInfo:
        return self.filesystem().get_file_info(path or self.base)


def signature(size: int | None, mtime_ns: int | None) -> str:
    """What a listing says about a file's content: its size and modification time (ns)."""
    return f"{size}:{mtime_ns}"
