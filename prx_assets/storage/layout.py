"""Where everything lives: one root URI and the layout under it.

A `Storage` maps (table, source) to a location and opens it; it also names the MDS root,
the opt-out request folder and the ablation lists. Locations are URI strings, so the root can be
a local folder today and an object-store prefix without changing any caller.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional

import lance

from prx_assets.storage import object_store
from prx_assets.storage.tables import GLOBAL, PER_SOURCE

DATA_ROOT_ENV = "PRX_DATA_ROOT"
DEFAULT_DATA_ROOT = "./data"
MDS_DIR = "mds"
OPT_OUTS_DIR = "opt_outs"
ABLATIONS_DIR = "ablations"


def _normalise_root(root: str) -> str:
    """Object-store URIs stay as given (no trailing slash); local folders become absolute."""
    if "://" in root and not root.startswith("file://"):
        return root.rstrip("/")
    return str(Path(root.removeprefix("file://")).expanduser().resolve())


@dataclass(frozen=True)
class Storage:
    """The corpus's storage root (`PRX_DATA_ROOT`) and what lies under it.

    On an object store, credentials and endpoint come from the standard AWS variables;
    `storage_options` (Lance's key names, e.g. `aws_endpoint`, `aws_access_key_id`,
    `allow_http`, `timeout`) override them and go with every Lance call made through here.
    """

    root: str
    storage_options: Optional[Mapping[str, str]] = field(default=None, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", _normalise_root(str(self.root)))
        if self.storage_options is not None:
            object.__setattr__(self, "storage_options", dict(self.storage_options))

    @classmethod
    def from_env(cls) -> "Storage":
        return cls(os.environ.get(DATA_ROOT_ENV) or DEFAULT_DATA_ROOT)

    @property
    def is_local(self) -> bool:
        return "://" not in self.root

    def lance_options(self) -> Optional[dict[str, str]]:
        """Storage options for a Lance or Ray Data call on a location under this root: None
        locally; on an object store the bounded timeouts and retries, the standard variables
        and this Storage's overrides, resolved here (on the driver) so that Ray tasks get
        them whatever their own environment holds."""
        return object_store.lance_options(self.root, self.storage_options)

    def check_reachable(self) -> None:
        """On an object store, fail at once naming the root and the cause (missing bucket,
        refused credentials, unreachable endpoint); locally nothing to check."""
        object_store.check_reachable(self.root, self.storage_options)

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
        self.check_reachable()
        try:
            return lance.dataset(uri, version=version, storage_options=self.lance_options())
        except (ValueError, FileNotFoundError, OSError) as exc:
            if not (self.is_local or object_store.is_not_found(exc)):
                raise object_store.ObjectStoreError(f"cannot read Lance table {uri}: {exc}") \
                    from exc
            raise FileNotFoundError(f"cannot open Lance table {uri}"
                                    + (f" at version {version}" if version is not None else "")
                                    + f": {exc}") from exc

    def latest_version(self, name: str, source: Optional[str] = None) -> Optional[int]:
        """The table's latest committed version, or None if it was never written."""
        uri = self.table(name, source)
        if self.is_local and not Path(uri).exists():
            return None
        self.check_reachable()
        try:
            return lance.dataset(uri, storage_options=self.lance_options()).version
        except (ValueError, FileNotFoundError, OSError) as exc:
            if self.is_local or object_store.is_not_found(exc):
                return None
            raise object_store.ObjectStoreError(f"cannot read Lance table {uri}: {exc}") from exc

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

    def local_path(self, uri: str) -> Path:
        """A location under a local root as a Path, for code that needs a POSIX folder
        (symlink swaps, renames); object-store roots are refused with the URI named."""
        if not self.is_local:
            raise NotImplementedError(f"{uri}: this step needs a local folder")
        return Path(uri)


def as_storage(storage: "Storage | str | Path") -> Storage:
    """A Storage, or the root URI (or local folder) to build one from."""
    return storage if isinstance(storage, Storage) else Storage(str(storage))
