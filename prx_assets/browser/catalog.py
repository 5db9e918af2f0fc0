"""Which tables the corpus browser can read: found under the storage root, opened once and
reused, with the caches that hang off their versions.

Table locations come from the storage layer (`Storage.table`), for sources found by listing
the folder of each per-source table (`Storage.table_folder`: a local folder, or an `s3://`
prefix): a request names a sample id, which is looked up in a table, and a source only
counts once it is one of those; nothing from a request is joined into a path.

The browser's only calls into the MDS and skip-list stages are here (`Catalog.mds_tree`,
`Catalog.sidecars`, `Catalog.sidecar`, `Sidecar.lists`): a source's current tree and the
skip-list sidecars beside its shards, read as the loader reads them. Trees are read from a
local root only; on an `s3://` root the pages show no skip reasons.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prx_assets.storage.layout import Storage, as_storage
from prx_assets.storage.refs import Location, TableRef
from prx_assets.storage.sidecars import (
    SHARD_SUFFIX,
    SIDECAR_SUFFIX,
    read_sidecar,
    sidecar_files,
    sidecar_path,
)
from prx_assets.storage.sidecars import (
    # What the loader skips by default, for the pages that count skips (re-exported).
    applies_by_default as applies_by_default,
)
from prx_assets.storage.tables import CORPUS, MDS_SAMPLES, PER_SOURCE
from prx_assets.storage.trees import current_tree

if TYPE_CHECKING:
    from lance import LanceDataset

TABLE_TTL_S = 2.0  # a table opened is reused this long before its latest version is checked
CACHED_KEYS = 64  # derived values held at once (their keys name table versions)

SAMPLE_ID = re.compile(r"^[a-z0-9_]+:[0-9A-Za-z_.\-]{1,128}$")
NAME = re.compile(r"^[a-z0-9_]+$")


class NotFound(Exception):
    """The thing asked for does not exist (the web app answers 404)."""


class BadQuery(ValueError):
    """A parameter that cannot be a valid value (the web app answers 400)."""


def valid_id(sample_id: str) -> str:
    if not isinstance(sample_id, str) or not SAMPLE_ID.match(sample_id):
        raise NotFound(f"no sample with id {sample_id!r}")
    return sample_id


@dataclass(frozen=True)
class Sidecar:
    """The skip-list sidecar of one shard in a source's current tree."""

    leaf: str  # relative to the tree, e.g. 512/512x512
    shard: str  # e.g. shard.00003.mds
    path: Path

    def stamp(self) -> tuple[str, int]:
        """Path and mtime: a rewritten skip list changes the stamp."""
        return str(self.path), self.path.stat().st_mtime_ns

    def lists(self) -> dict[str, list[int]]:
        """Shard-local sample indices by reason ({} when the sidecar is absent)."""
        return read_sidecar(self.path)


class Catalog:
    """The storage root's tables; datasets are opened once and re-checked for a newer
    version every `ttl_s` seconds (TABLE_TTL_S unless told; 0 re-checks on every call, so
    a page reloaded after a write shows it)."""

    def __init__(self, storage: Storage | str | Path, ttl_s: float = TABLE_TTL_S):
        self.storage = as_storage(storage)
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._open: dict[str, tuple[float, LanceDataset | None]] = {}
        self._cache: dict[tuple, Any] = {}
        self._fresh: dict[str, tuple[float, Any]] = {}

    # ------------------------------------------------------------------------------ tables

    def sources_of(self, asset: str) -> list[str]:
        """Sources that have a table of the per-source `asset`: the `<source>.lance` folders
        in its table folder (on an object store one listing request, reused for
        `ttl_s` seconds)."""
        if asset not in PER_SOURCE:
            return []
        folder = self.storage.table_folder(asset)
        if folder.is_local:
            return _table_sources(folder)
        return self.fresh(f"sources/{asset}", lambda: _table_sources(folder))

    def dataset(self, asset: str, source: str | None = None) -> LanceDataset | None:
        """The global table `asset`, or its table for a known `source` (else None)."""
        if source is None:
            return self._dataset(self.storage.table(asset))
        if source not in self.sources_of(asset):
            return None
        return self._dataset(self.storage.table(asset, source))

    def corpus(self) -> LanceDataset:
        table = self.dataset(CORPUS)
        if table is None:
            raise NotFound("no corpus table yet: materialise the `corpus` asset "
                           "(e.g. `make demo`)")
        return table

    def _dataset(self, table: TableRef) -> LanceDataset | None:
        now = time.monotonic()
        with self._lock:
            held = self._open.get(table.uri)
        if held and now - held[0] < self.ttl_s:
            return held[1]
        dataset = held[1] if held else None
        try:
            if dataset is None or dataset.latest_version != dataset.version:
                dataset = table.latest().open()
        except (ValueError, OSError):
            dataset = None  # not written yet
        with self._lock:
            self._open[table.uri] = (now, dataset)
        return dataset

    # --------------------------------------------------------------- MDS trees, skip lists

    def mds_tree(self, source: str) -> Path | None:
        """The source's current MDS tree, resolved once; None without one (or on an
        object-store root)."""
        if not self.storage.is_local or source not in self.sources_of(MDS_SAMPLES):
            return None
        try:
            return current_tree(self.storage.mds_root.path, source)
        except FileNotFoundError:
            return None

    def sidecars(self, source: str) -> list[Sidecar]:
        """Every skip-list sidecar of the source's current tree."""
        tree = self.mds_tree(source)
        if tree is None:
            return []
        return [Sidecar(str(path.parent.relative_to(tree)),
                        path.name.removesuffix(SIDECAR_SUFFIX) + SHARD_SUFFIX, path)
                for path in sidecar_files(tree)]

    def sidecar(self, source: str, leaf: str, shard: str) -> Sidecar | None:
        """The sidecar of one shard of the source's current tree (None without a tree)."""
        tree = self.mds_tree(source)
        if tree is None:
            return None
        path = sidecar_path(tree / leaf / shard)
        # Leaf and shard come from the mapping table (no request input); a value that would
        # leave the tree is ignored all the same.
        if not path.resolve().is_relative_to(tree.resolve()):
            return None
        return Sidecar(leaf, shard, path)

    # ------------------------------------------------------------------------------ caches

    def cached(self, key: tuple, compute: Callable[[], Any]) -> Any:
        """One value per key (keys hold table versions or file stamps, so they go stale by
        themselves); at most CACHED_KEYS keys are ever held."""
        with self._lock:
            if key in self._cache:
                return self._cache[key]
        value = compute()
        with self._lock:
            while len(self._cache) >= CACHED_KEYS:  # the oldest keys are the stale versions
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = value
        return value

    def fresh(self, name: str, compute: Callable[[], Any]) -> Any:
        """`compute()`, reused for `ttl_s` seconds (for things without a version, such
        as the list of sidecar files)."""
        now = time.monotonic()
        with self._lock:
            held = self._fresh.get(name)
        if held and now - held[0] < self.ttl_s:
            return held[1]
        value = compute()
        with self._lock:
            self._fresh[name] = (now, value)
        return value


def _table_sources(folder: Location) -> list[str]:
    """Names of the `<name>.lance` tables directly in `folder`."""
    names = (name.removesuffix(".lance") for name in folder.folders()
             if name.endswith(".lance"))
    return sorted(name for name in names if NAME.match(name))
