"""Where everything lives: one root URI and the layout under it.

A `Storage` maps (table, source) to a location and opens it; it also names the MDS root,
the opt-out request folder and scratch space. Locations are URI strings, so the root can be
a local folder today and an object-store prefix without changing any caller.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import lance

from prx_assets.storage.tables import GLOBAL, PER_SOURCE

DATA_ROOT_ENV = "PRX_DATA_ROOT"
DEFAULT_DATA_ROOT = "./data"
MDS_DIR = "mds"
OPT_OUTS_DIR = "opt_outs"
ABLATIONS_DIR = "ablations"
WORK_DIR = "_work"


def _normalise_root(root: str) -> str:
    """Object-store URIs stay as given (no trailing slash); local folders become absolute."""
    if "://" in root and not root.startswith("file://"):
        return root.rstrip("/")
    return str(Path(root.removeprefix("file://")).expanduser().resolve())


@dataclass(frozen=True)
class Storage:
    """The corpus's storage root (`PRX_DATA_ROOT`) and what lies under it."""

    root: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", _normalise_root(str(self.root)))

    @classmethod
    def from_env(cls) -> "Storage":
        return cls(os.environ.get(DATA_ROOT_ENV) or DEFAULT_DATA_ROOT)

    @property
    def is_local(self) -> bool:
        return "://" not in self.root

    def _join(self, *parts: str) -> str:
        return "/".join((self.root, *parts))

    def table(self, name: str, source: Optional[str] = None) -> str:
        """The URI of a table: `lance/<name>/<source>.lance`, or `lance/<name>.lance`."""
        if name in PER_SOURCE:
            if not source:
                raise ValueError(f"table {name!r} is per source: name the source")
            return self._join("lance", name, f"{source}.lance")
        if name in GLOBAL:
            if source:
                raise ValueError(f"table {name!r} spans every source: it takes no source")
            return self._join("lance", f"{name}.lance")
        raise ValueError(f"unknown table {name!r}; tables are {PER_SOURCE + GLOBAL}")

    def exists(self, name: str, source: Optional[str] = None) -> bool:
        return self.latest_version(name, source) is not None

    def open(self, name: str, source: Optional[str] = None,
             version: Optional[int] = None) -> lance.LanceDataset:
        """The table at `version` (the latest if None); fails naming the URI if absent."""
        uri = self.table(name, source)
        try:
            return lance.dataset(uri, version=version)
        except (ValueError, FileNotFoundError, OSError) as exc:
            raise FileNotFoundError(f"cannot open Lance table {uri}"
                                    + (f" at version {version}" if version is not None else "")
                                    + f": {exc}") from exc

    def latest_version(self, name: str, source: Optional[str] = None) -> Optional[int]:
        """The table's latest committed version, or None if it was never written."""
        uri = self.table(name, source)
        if self.is_local and not Path(uri).exists():
            return None
        try:
            return lance.dataset(uri).version
        except (ValueError, FileNotFoundError, OSError):
            return None

    @property
    def mds_root(self) -> str:
        """Where every source's MDS tree lives (`mds/<source>/<tier>/<W>x<H>/`)."""
        return self._join(MDS_DIR)

    def mds_tree(self, source: str) -> str:
        return self._join(MDS_DIR, source)

    @property
    def opt_outs_dir(self) -> str:
        """The folder users drop opt-out request files into."""
        return self._join(OPT_OUTS_DIR)

    @property
    def ablations_dir(self) -> str:
        """Named ablation lists: `<name>.txt`, one sample id per line."""
        return self._join(ABLATIONS_DIR)

    def work_dir(self, *parts: str) -> str:
        """Scratch space for a run (e.g. an ingest manifest), removed when the run ends."""
        return self._join(WORK_DIR, *parts)

    def local_path(self, uri: str) -> Path:
        """A location under a local root as a Path, for code that needs a POSIX folder
        (symlink swaps, renames); object-store roots are refused with the URI named."""
        if not self.is_local:
            raise NotImplementedError(f"{uri}: this step needs a local folder")
        return Path(uri)


def as_storage(storage: "Storage | str | Path") -> Storage:
    """A Storage, or the root URI (or local folder) to build one from."""
    return storage if isinstance(storage, Storage) else Storage(str(storage))
