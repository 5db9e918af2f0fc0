"""Where everything lives: one root URI and the layout under it.

A `Storage` maps (table, source) to a `TableRef` and a path under the root to a `Location`;
it also names the MDS root, the opt-out request folder and the ablation lists. Handles hold
URIs, so the root can be a local folder or an object-store prefix without changing any
caller.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from prx_assets.storage import object_store
from prx_assets.storage.object_store import StoreSettings
from prx_assets.storage.refs import Location, TableRef
from prx_assets.storage.tables import GLOBAL, PER_SOURCE

DATA_ROOT_ENV = "PRX_DATA_ROOT"
DEFAULT_DATA_ROOT = "./data"
MDS_DIR = "mds"
OPT_OUTS_DIR = "opt_outs"
ABLATIONS_DIR = "ablations"
RIGHTS_DIR = "rights"


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
    `allow_http`, `timeout`) override them. They are resolved once, here, into the settings
    every handle this Storage makes carries (`table`, `location`); neither prints them.
    """

    root: str
    storage_options: Mapping[str, str] | None = field(default=None, hash=False, repr=False)
    settings: StoreSettings | None = field(default=None, init=False, repr=False,
                                              compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", _normalise_root(str(self.root)))
        if self.storage_options is not None:
            object.__setattr__(self, "storage_options", dict(self.storage_options))
        if not self.is_local:
            object.__setattr__(self, "settings",
                               StoreSettings.resolve(self.root, self.storage_options))

    @classmethod
    def from_env(cls) -> Storage:
        return cls(os.environ.get(DATA_ROOT_ENV) or DEFAULT_DATA_ROOT)

    @classmethod
    def above(cls, mds_root: Location) -> Storage:
        """The storage whose MDS root is `mds_root`, with that handle's settings (a tree
        store knows its MDS root only)."""
        storage = cls(mds_root.parent.uri)
        object.__setattr__(storage, "settings", mds_root.settings)
        return storage

    @property
    def is_local(self) -> bool:
        return "://" not in self.root

    def check_reachable(self) -> None:
        """On an object store, fail at once naming the root and the cause (missing bucket,
        refused credentials, unreachable endpoint); locally nothing to check."""
        if self.settings:
            object_store.check_reachable(self.root, self.settings)

    def location(self, *parts: str) -> Location:
        """A file or folder under the root (`location("mds", "web")`)."""
        return Location("/".join((self.root, *parts)), self.settings)

    def table(self, name: str, source: str | None = None) -> TableRef:
        """A table: `lance/<name>/<source>.lance`, or `lance/<name>.lance` (the latest
        version; `.at(version)` pins it)."""
        if name in PER_SOURCE:
            if not source:
                raise ValueError(f"table {name!r} is per source: name the source")
            return (self.table_folder(name) / f"{source}.lance").as_table()
        if name in GLOBAL:
            if source:
                raise ValueError(f"table {name!r} spans every source: it takes no source")
            return self.location("lance", f"{name}.lance").as_table()
        raise ValueError(f"unknown table {name!r}; tables are {PER_SOURCE + GLOBAL}")

    def table_folder(self, name: str) -> Location:
        """The folder holding every source's table of the per-source `name`
        (`lance/<name>/`, one `<source>.lance` in it per source)."""
        if name not in PER_SOURCE:
            raise ValueError(f"table {name!r} is not per source; those are {PER_SOURCE}")
        return self.location("lance", name)

    @property
    def mds_root(self) -> Location:
        """Where every source's MDS tree lives (`mds/<source>/<tier>/<W>x<H>/`)."""
        return self.location(MDS_DIR)

    @property
    def opt_outs_dir(self) -> Location:
        """The folder users drop opt-out request files into."""
        return self.location(OPT_OUTS_DIR)

    @property
    def rights_dir(self) -> Location:
        """Rights reservations beside the opt-outs: `domains/*.txt` (reserved domains and
        URL prefixes) and `clearances/*.jsonl` (curators' clearances, audited like
        opt-out requests); see docs/rights.md."""
        return self.location(RIGHTS_DIR)

    @property
    def ablations_dir(self) -> Location:
        """Named ablation lists: `<name>.txt`, one sample id per line."""
        return self.location(ABLATIONS_DIR)


def as_storage(storage: Storage | str | Path) -> Storage:
    """A Storage, or the root URI (or local folder) to build one from."""
    return storage if isinstance(storage, Storage) else Storage(str(storage))
