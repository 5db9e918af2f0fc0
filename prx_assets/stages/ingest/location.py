"""Where a source lives: a `Location` (a local folder or file, or an object-store prefix
`s3://...`) that may name one file, opened through `pyarrow.fs` so every reader streams
from either the same way.

A location is resolved on the driver (the standard AWS variables and any overrides become
explicit settings, see `storage.object_store.StoreSettings`) and pickled into Ray tasks, which
build their file system from those settings, never from their own environment.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pyarrow.fs as pafs

from prx_assets.storage.refs import Location


@dataclass(frozen=True)
class SourceLocation(Location):
    """A source's `uri` as a `Location`, and whether it names one file (a single tar or
    parquet file) rather than a folder or prefix: its units are then that file alone."""

    single_file: bool = False

    @property
    def base(self) -> str:
        """The location as the file system names it (`bucket/prefix` on S3)."""
        return self.filesystem()[1]

    def path_of(self, rel: str) -> str:
        """The file system path of a unit (a path relative to the location)."""
        return self.base if self.single_file else f"{self.base.rstrip('/')}/{rel}"

    def as_single_file(self) -> SourceLocation:
        return replace(self, single_file=True)

    def info(self, path: str | None = None) -> pafs.FileInfo:
        fs, base = self.filesystem()
        return fs.get_file_info(path or base)


def signature(size: int | None, mtime_ns: int | None) -> str:
    """What a listing says about a file's content: its size and modification time (ns)."""
    return f"{size}:{mtime_ns}"
