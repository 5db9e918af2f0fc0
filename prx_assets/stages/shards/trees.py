"""Where a source's versioned MDS trees live and which one is current: a local folder with a
symlink, or an object-store prefix with a pointer object.

    local:  mds/<source> -> .trees/<source>/<version>     (symlink, replaced with os.replace)
    s3://:  mds/<source>.current.json = {"version": ..., "tree": "<uri>"}   (one PUT, last)

Both: `mds/.trees/<source>/<version>/<tier>/<W>x<H>/{index.json, shard.NNNNN.mds,
shard.NNNNN.skip.json}` plus `tree.json`, the version's manifest, written last inside it. A
reader resolves "current" once (the link, or one GET of the pointer) and reads that version
whole; a writer builds a new version aside and publishes it last. Locally a build happens in
`<version>.partial/` and is renamed when complete; on S3 the version's prefix is unreadable
to readers until the pointer names it.

Files carried from one version into the next are hard links locally (same inode, no bytes
copied; a copy only across devices, logged) and server-side copies (CopyObject) on S3: S3
has no links, and mosaicml-streaming resolves a shard's basename under its leaf, so a
shard of another version's prefix cannot be named from this version's index.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Mapping, Optional

from prx_assets.storage import object_store
from prx_assets.storage.layout import Storage

logger = logging.getLogger(__name__)

TREES_DIR = ".trees"
PARTIAL_SUFFIX = ".partial"
TREE_MANIFEST = "tree.json"
POINTER_SUFFIX = ".current.json"
COPY_THREADS = 16  # concurrent server-side copies when carrying a version's files on S3


def new_tree_version() -> str:
    """Sortable and unique per build: UTC time to the microsecond."""
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")


@dataclass
class TreeStore:
    """One source's trees under an MDS root (a local folder or an `s3://` prefix)."""

    mds_root: str
    source: str
    storage_options: Optional[Mapping[str, str]] = None
    log: Callable[[str], None] = logger.info

    @property
    def is_local(self) -> bool:
        return not object_store.is_object_store(self.mds_root)

    @property
    def trees_dir(self) -> str:
        return f"{self.mds_root}/{TREES_DIR}/{self.source}"

    @property
    def link(self) -> str:
        """Local: the symlink naming the current version. S3: the pointer object."""
        if self.is_local:
            return f"{self.mds_root}/{self.source}"
        return f"{self.mds_root}/{self.source}{POINTER_SUFFIX}"

    def tree_uri(self, version: str) -> str:
        return f"{self.trees_dir}/{version}"

    def staging_uri(self, version: str) -> str:
        """Where a version is built: aside locally, its own (unpublished) prefix on S3."""
        return self.tree_uri(version) + (PARTIAL_SUFFIX if self.is_local else "")

    # ------------------------------------------------------------------ reading
    def current_version(self) -> Optional[str]:
        if self.is_local:
            link = Path(self.link)
            # A real folder in place of the link reads as a tree (publishing refuses it).
            return link.resolve().name if link.exists() else None
        try:
            return str(json.loads(self.read_text(self.link))["version"])
        except FileNotFoundError:
            return None

    def current_tree(self) -> str:
        """The current version's location, resolved once (a later swap does not move it)."""
        version = self.current_version()
        if version is None:
            raise FileNotFoundError(f"no MDS tree for source {self.source!r} at {self.link}; "
                                    "materialise mds_shards first")
        return str(Path(self.link).resolve()) if self.is_local else self.tree_uri(version)

    def manifest(self, version: str) -> Optional[dict]:
        try:
            return json.loads(self.read_text(f"{self.tree_uri(version)}/{TREE_MANIFEST}"))
        except FileNotFoundError:
            return None

    def versions(self) -> list[str]:
        """Complete versions (their manifest written), oldest first."""
        fs, path = self.fs(self.trees_dir)
        import pyarrow.fs as pafs

        names = sorted(info.base_name for info in fs.get_file_info(
            pafs.FileSelector(path, allow_not_found=True)) if info.type == pafs.FileType.Directory)
        return [n for n in names if not n.endswith(PARTIAL_SUFFIX)
                and self.exists(f"{self.tree_uri(n)}/{TREE_MANIFEST}")]

    def read_text(self, uri: str) -> str:
        return object_store.read_text(uri, self.storage_options)

    def exists(self, uri: str) -> bool:
        import pyarrow.fs as pafs

        fs, path = self.fs(uri)
        return fs.get_file_info(path).type != pafs.FileType.NotFound

    def files(self, folder: str, suffix: str = "") -> list[str]:
        return object_store.list_files(folder, suffix, self.storage_options)

    # ------------------------------------------------------------------ writing
    def prepare(self) -> None:
        if self.is_local:
            Path(self.trees_dir).mkdir(parents=True, exist_ok=True)
        else:
            object_store.check_reachable(self.mds_root, self.storage_options)

    def make_dirs(self, folder: str) -> None:
        if self.is_local:
            Path(folder).mkdir(parents=True, exist_ok=True)

    def write_text(self, uri: str, text: str) -> None:
        """Locally through a temporary file and a rename (readers never see half a file);
        on S3 one PUT (an object is visible whole or not at all)."""
        if not self.is_local:
            object_store.write_text(uri, text, self.storage_options)
            return
        path = Path(uri)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as handle:
                handle.write(text)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def carry(self, src: str, dst: str) -> None:
        """An older version's file into a new version without moving its bytes through us:
        a hard link locally (a copy only across devices), a server-side copy on S3."""
        if not self.is_local:
            fs, source = self.fs(src)
            fs.copy_file(source, self.fs(dst)[1])
            return
        Path(dst).parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(src, dst)
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
            self.log(f"{src}: on another device than {dst}; copied instead of linked")
            shutil.copy2(src, dst)

    def carry_many(self, pairs: list[tuple[str, str]]) -> None:
        """`carry` for many files: on S3 the copies run concurrently (each is one request
        that waits on the store; 100k shards one after another would take hours)."""
        if self.is_local or len(pairs) < 2:
            for src, dst in pairs:
                self.carry(src, dst)
            return
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(COPY_THREADS) as pool:
            for _ in pool.map(lambda pair: self.carry(*pair), pairs):
                pass

    def move(self, src: str, dst: str) -> None:
        if self.is_local:
            os.replace(src, dst)
            return
        fs, source = self.fs(src)
        fs.copy_file(source, self.fs(dst)[1])
        fs.delete_file(source)

    def delete_tree(self, uri: str) -> None:
        if self.is_local:
            shutil.rmtree(uri, ignore_errors=True)
            return
        fs, path = self.fs(uri)
        try:
            fs.delete_dir(path)
        except FileNotFoundError:
            pass

    def finish(self, version: str) -> str:
        """A built version made complete (its manifest already inside): renamed locally."""
        final = self.tree_uri(version)
        if self.is_local:
            os.rename(self.staging_uri(version), final)
        return final

    def publish(self, version: str) -> None:
        """Make `version` current, atomically: replace the symlink, or PUT the pointer."""
        if not self.is_local:
            self.write_text(self.link, json.dumps(
                {"version": version, "tree": self.tree_uri(version)}, sort_keys=True))
            return
        link = Path(self.link)
        if link.exists() and not link.is_symlink():
            raise RuntimeError(f"{link} is a real folder, not the tree symlink; move it away first")
        target = Path(self.tree_uri(version))
        temporary = link.with_name(f".{link.name}.{version}.link")
        if os.path.lexists(temporary):
            temporary.unlink()
        os.symlink(os.path.relpath(target, link.parent), temporary)
        os.replace(temporary, link)

    def remove_unpublished(self, keep: frozenset[str] = frozenset()) -> None:
        """Leftovers of killed builds: `.partial` folders, and complete versions newer than
        the current one that never became current (except `keep`)."""
        current = self.current_version()
        if self.is_local:
            for partial in Path(self.trees_dir).glob("*" + PARTIAL_SUFFIX):
                shutil.rmtree(partial, ignore_errors=True)
        for version in self._all_version_dirs():
            if version in keep or version.endswith(PARTIAL_SUFFIX):
                continue
            if current is None or version > current:
                self.delete_tree(self.tree_uri(version))

    def prune(self, keep: int) -> None:
        """Keep the current version and the `keep - 1` before it (a trainer may still read
        one it resolved earlier)."""
        current = self.current_version()
        published = [v for v in self._all_version_dirs()
                     if not v.endswith(PARTIAL_SUFFIX) and current and v <= current]
        for old in published[:-max(1, keep)]:
            self.delete_tree(self.tree_uri(old))

    def _all_version_dirs(self) -> list[str]:
        import pyarrow.fs as pafs

        fs, path = self.fs(self.trees_dir)
        return sorted(info.base_name for info in fs.get_file_info(
            pafs.FileSelector(path, allow_not_found=True)) if info.type == pafs.FileType.Directory)

    def fs(self, uri: str):
        """(pyarrow FileSystem, path) for a location under this store."""
        return object_store.filesystem(uri, self.storage_options)


def tree_store(storage: Storage, source: str, log: Callable[[str], None] = logger.info
               ) -> TreeStore:
    return TreeStore(storage.mds_root, source, storage.storage_options, log)


def leaf_names(store: TreeStore, tree: str) -> list[str]:
    """Leaves (`<tier>/<W>x<H>`, the folders holding an index.json) of a tree, sorted."""
    import pyarrow.fs as pafs

    fs, path = store.fs(tree)
    infos = fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True))
    root = path.rstrip("/") + "/"
    names = []
    for info in infos:
        if info.type == pafs.FileType.File and info.base_name == "index.json":
            rel = info.path[len(root):] if info.path.startswith(root) else info.path
            parts = rel.split("/")
            if len(parts) == 3:
                names.append(f"{parts[0]}/{parts[1]}")
    return sorted(names)
