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

The loader, the browser and `prx-assets mds-uri` resolve trees through this module alone: it
imports neither Ray nor mosaicml-streaming (a trainer's process pays for neither).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from itertools import pairwise
from pathlib import Path, PurePath

from prx_assets.storage.layout import MDS_DIR, Storage, as_storage
from prx_assets.storage.leases import ReaderLease, held_versions, lease_file, take_reader_lease
from prx_assets.storage.refs import Location, as_location, sync_folder, sync_paths

logger = logging.getLogger(__name__)

TREES_DIR = ".trees"
PARTIAL_SUFFIX = ".partial"
TREE_MANIFEST = "tree.json"
POINTER_SUFFIX = ".current.json"
INDEX = "index.json"
COPY_THREADS = 16  # concurrent server-side copies when carrying a version's files on S3
VERSION_FORMAT = "%Y%m%dT%H%M%S%fZ"
# How long a tree superseded by a newer one stays, when no reader lease holds it longer.
DEFAULT_RETENTION = timedelta(days=7)


class TreeConflictError(RuntimeError):
    """The pointer no longer names the tree a build started from: another writer published
    in between; publishing would discard its tree."""


def new_tree_version() -> str:
    """Sortable and unique per build: UTC time to the microsecond."""
    return datetime.now(UTC).strftime(VERSION_FORMAT)


def version_time(version: str) -> datetime:
    return datetime.strptime(version, VERSION_FORMAT).replace(tzinfo=UTC)


def leaf_name(tier: int, width: int, height: int) -> str:
    return f"{tier}/{width}x{height}"


def leaf_key(name: str) -> tuple[int, int, int]:
    """`512/640x480` -> (512, 640, 480)."""
    tier, shape = name.split("/")
    width, height = shape.split("x")
    return int(tier), int(width), int(height)


def lineage(manifest: dict, version: str) -> list[str]:
    """Every version whose shards the tree `version` holds (itself included): the
    `tree_version` values its mapping rows may carry."""
    own = manifest.get("shards_of", version)  # a skip-lists version holds its parent's shards
    return sorted({*manifest.get("carried_versions", []), own})


@dataclass
class TreeStore:
    """One source's trees under an MDS root (a local folder or an `s3://` prefix)."""

    mds_root: Location
    source: str
    log: Callable[[str], None] = logger.info
    # Where a tree kind other than a source's lives below `$PRX_DATA_ROOT/mds` ("subsets"):
    # its trees sit under `mds/<kind>/`, its reader leases under `leases/readers/<kind>/`.
    kind: str = ""

    @property
    def is_local(self) -> bool:
        return self.mds_root.is_local

    @property
    def data_root(self) -> Location:
        """`$PRX_DATA_ROOT`, above the MDS root: where leases live."""
        return self.mds_root.parent.parent if self.kind else self.mds_root.parent

    @property
    def reader_key(self) -> str:
        """What reader leases of these trees are filed under (a subset's apart from a
        source of the same name)."""
        return f"{self.kind}/{self.source}" if self.kind else self.source

    @property
    def trees_dir(self) -> Location:
        return self.mds_root / TREES_DIR / self.source

    @property
    def link(self) -> Location:
        """Local: the symlink naming the current version. S3: the pointer object."""
        return self.mds_root / (self.source if self.is_local else self.source + POINTER_SUFFIX)

    def tree(self, version: str) -> Location:
        return self.trees_dir / version

    def staging(self, version: str) -> Location:
        """Where a version is built: aside locally, its own (unpublished) prefix on S3."""
        return self.trees_dir / (version + (PARTIAL_SUFFIX if self.is_local else ""))

    # ------------------------------------------------------------------ reading
    def current_version(self) -> str | None:
        if self.is_local:
            link = self.link.path
            # A real folder in place of the link reads as a tree (publishing refuses it).
            return link.resolve().name if link.exists() else None
        try:
            return str(json.loads(self.link.read_text())["version"])
        except FileNotFoundError:
            return None

    def current_tree(self) -> Location:
        """The current version's location, resolved once (a later swap does not move it)."""
        version = self.current_version()
        if version is None:
            raise FileNotFoundError(f"no MDS tree for source {self.source!r} at {self.link}; "
                                    "materialise mds_shards first")
        if self.is_local:
            return Location(str(self.link.path.resolve()))
        return self.tree(version)

    def manifest(self, version: str) -> dict | None:
        try:
            return json.loads((self.tree(version) / TREE_MANIFEST).read_text())
        except FileNotFoundError:
            return None

    def versions(self) -> list[str]:
        """Complete versions (their manifest written), oldest first."""
        return [name for name in self.trees_dir.folders() if not name.endswith(PARTIAL_SUFFIX)
                and (self.tree(name) / TREE_MANIFEST).exists()]

    # ------------------------------------------------------------------ writing
    def prepare(self) -> None:
        if self.is_local:
            self.trees_dir.make_dirs()
        else:
            self.mds_root.check_reachable()

    def carry(self, src: Location, dst: Location) -> None:
        """An older version's file into a new version without moving its bytes through us:
        a hard link locally (a copy only across devices), a server-side copy on S3."""
        if not self.is_local:
            src.copy_to(dst)
            return
        dst.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(src.path, dst.path)
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
            self.log(f"{src}: on another device than {dst}; copied instead of linked")
            shutil.copy2(src.path, dst.path)

    def carry_many(self, pairs: list[tuple[Location, Location]]) -> None:
        """`carry` for many files: on S3 the copies run concurrently (each is one request
        that waits on the store; 100k shards one after another would take hours)."""
        if self.is_local or len(pairs) < 2:
            for src, dst in pairs:
                self.carry(src, dst)
            return
        with ThreadPoolExecutor(COPY_THREADS) as pool:
            for _ in pool.map(lambda pair: self.carry(*pair), pairs):
                pass

    def move(self, src: Location, dst: Location) -> None:
        if self.is_local:
            os.replace(src.path, dst.path)
            return
        src.copy_to(dst)
        src.delete()

    def finish(self, version: str) -> Location:
        """A built version made complete (its manifest already inside): renamed locally.

        The order a crash relies on: every file and folder of the version (shards written
        plainly by the part tasks, sidecars, the leaves' indexes written unflushed by
        `write_index`) reaches the disk with its folder, then the rename, then the trees folder; the
        publish that names the version comes after (`publish`). A power loss after a
        rename whose shards were still in the page cache would publish zero-filled shards."""
        final = self.tree(version)
        if self.is_local:
            staged = self.staging(version).path
            sync_paths(_written_here(staged))
            os.rename(staged, final.path)
            sync_folder(self.trees_dir.path)
        return final

    def publish(self, version: str, expected: str | None) -> None:
        """Make `version` current if the pointer still names `expected` (the tree the build
        started from; None: no tree yet), atomically: compare-and-swap of the pointer (a
        PUT with `If-Match` on its ETag, or `If-None-Match: *`), or of the symlink under an
        flock of `.trees/<source>.lock`. TreeConflictError when another writer published
        in between."""
        if not self.is_local:
            self._swap_pointer(version, expected)
            return
        with self.pointer_lock():
            named = self.current_version()
            if named != expected:
                raise self.conflict(version, expected, named)
            self._replace_link(version)

    def conflict(self, version: str, expected: str | None, named: str | None
                  ) -> TreeConflictError:
        return TreeConflictError(
            f"{self.source}: not publishing tree {version}: it was built from tree "
            f"{expected or '(none)'} but {named or '(none)'} is current now (another writer "
            "published meanwhile); rerun to build on the current tree")

    def _swap_pointer(self, version: str, expected: str | None) -> None:
        pointer = lease_file(self.link)  # conditional PUTs on the pointer object
        body = json.dumps({"version": version, "tree": str(self.tree(version))},
                          sort_keys=True).encode()
        current = pointer.read()
        named = str(json.loads(current[0])["version"]) if current else None
        if named != expected:
            raise self.conflict(version, expected, named)
        swapped = pointer.create(body) if current is None else pointer.replace(body, current[1])
        if swapped is None:
            raise self.conflict(version, expected, self.current_version())

    @contextmanager
    def pointer_lock(self) -> Iterator[None]:
        import fcntl

        self.trees_dir.make_dirs()
        with open(self.trees_dir.path.parent / f"{self.source}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _replace_link(self, version: str) -> None:
        link = self.link.path
        if link.exists() and not link.is_symlink():
            raise RuntimeError(f"{link} is a real folder, not the tree symlink; move it away first")
        temporary = link.with_name(f".{link.name}.{version}.link")
        if os.path.lexists(temporary):
            temporary.unlink()
        os.symlink(os.path.relpath(self.tree(version).path, link.parent), temporary)
        os.replace(temporary, link)

    def remove_unpublished(self, keep: frozenset[str] = frozenset()) -> None:
        """Leftovers of killed builds: `.partial` folders, and complete versions newer than
        the current one that never became current (except `keep`). Only the holder of the
        source's tree lease calls this: no other live writer is building then."""
        current = self.current_version()
        for name in self.trees_dir.folders():
            if name.endswith(PARTIAL_SUFFIX):
                (self.trees_dir / name).delete()
            elif name not in keep and (current is None or name > current):
                self.tree(name).delete()

    def prune(self, retention: timedelta = DEFAULT_RETENTION,
              now: datetime | None = None) -> list[str]:
        """Remove versions superseded longer than `retention` ago that no reader lease
        holds; the current version always stays. A version counts as superseded from its
        successor's build time. Returns the versions removed."""
        now = now or datetime.now(UTC)
        current = self.current_version()
        if current is None:
            return []
        published = [name for name in self.trees_dir.folders()
                     if not name.endswith(PARTIAL_SUFFIX) and name <= current]
        held = held_versions(self.data_root, self.reader_key) if published[:-1] else set()
        removed = []
        for old, successor in pairwise(published):
            if old in held or version_time(successor) > now - retention:
                continue
            self.tree(old).delete()
            removed.append(old)
        return removed


def tree_store(storage: Storage, source: str, log: Callable[[str], None] = logger.info
               ) -> TreeStore:
    return TreeStore(storage.mds_root, source, log)


def source_trees(root: Location | str | PurePath, source: str) -> TreeStore:
    """The source's trees under `root`: the MDS root (`$PRX_DATA_ROOT/mds`), or locally the
    data root above it."""
    root = as_location(root)
    if root.is_local and not os.path.lexists(root.path / source) \
            and os.path.lexists(root.path / MDS_DIR / source):
        root = root / MDS_DIR
    return TreeStore(root, source)


def current_tree(root: Location | str | PurePath, source: str) -> Path:
    """The source's current local tree, resolved once (a later swap does not move what you
    hold). `root` is the MDS root (`$PRX_DATA_ROOT/mds`); the data root above it is accepted
    too. For any root, local or s3://, see `current_tree_uri`."""
    return source_trees(root, source).current_tree().path


def hold_current_tree(root: Location | str | PurePath, source: str, seconds: float
                      ) -> tuple[Location, ReaderLease]:
    """The source's current tree, resolved once, with a reader lease on it for `seconds`:
    `prune` keeps a leased tree past its retention. The lease is taken before the tree is
    checked to still exist (a prune that listed the leases before it would have removed it
    already, and we resolve again)."""
    return hold_tree(source_trees(root, source), seconds)


def hold_tree(store: TreeStore, seconds: float) -> tuple[Location, ReaderLease]:
    """`hold_current_tree` for any trees (a source's, a subset's)."""
    for _ in range(3):
        tree = store.current_tree()
        lease = take_reader_lease(store.data_root, store.reader_key, tree.name, seconds)
        if (tree / TREE_MANIFEST).exists():
            return tree, lease
        lease.release()
    raise RuntimeError(f"{store.reader_key}: the current tree kept changing while a reader "
                       "lease was taken on it; try again")


def current_tree_uri(storage: Storage | str | Path, source: str) -> str:
    """The current tree of `source` as a location: a resolved local folder or the version's
    `s3://` prefix (what `prx-assets mds-uri` prints; `<it>/<tier>/<W>x<H>` is a stream)."""
    return str(tree_store(as_storage(storage), source).current_tree())


def leaf_names(tree: Location) -> list[str]:
    """Leaves (`<tier>/<W>x<H>`, the folders holding an index.json) of a tree, sorted: one
    listing per tier, one existence check per leaf (on S3 no listing of every shard)."""
    return sorted(f"{tier}/{shape}" for tier in tree.folders()
                  for shape in (tree / tier).folders() if (tree / tier / shape / INDEX).exists())


def tree_leaves(tree: Path, tier: int | None = None) -> list[Path]:
    """Leaf folders of a local tree, optionally of one tier, sorted."""
    pattern = f"{tier}/*/{INDEX}" if tier is not None else f"*/*/{INDEX}"
    return sorted(p.parent for p in Path(tree).glob(pattern))


def read_index(leaf: Location) -> list[dict]:
    """A leaf's index.json shard entries."""
    return json.loads((leaf / INDEX).read_text())["shards"]


def leaf_samples(leaf: Location | str | PurePath) -> int:
    """Samples the leaf's index lists (what a plain StreamingDataset of it counts)."""
    return sum(shard["samples"] for shard in read_index(as_location(leaf)))


def shard_problems(leaf: Location, entries: list[dict]) -> list[str]:
    """What is wrong with the shards a leaf's index lists: missing, or of another size than
    the index says (or another hash, where the index records one). One listing per leaf."""
    sizes = leaf.file_sizes()
    problems = []
    for entry in entries:
        for kind in ("raw_data", "zip_data"):
            info = entry.get(kind)
            if not info:
                continue
            name, expected = info["basename"], int(info["bytes"])
            if name not in sizes:
                problems.append(f"{leaf.name}/{name} is missing")
            elif sizes[name] != expected:
                problems.append(f"{leaf.name}/{name} has {sizes[name]} bytes, the index says "
                                f"{expected}")
            elif info.get("hashes"):
                problems += _hash_problems(leaf / name, info["hashes"])
    return problems


def _hash_problems(shard: Location, hashes: dict[str, str]) -> list[str]:
    import hashlib

    data = shard.read_bytes()
    return [f"{shard.name}: {algorithm} differs from the index"
            for algorithm, digest in sorted(hashes.items())
            if algorithm in hashlib.algorithms_available
            and hashlib.new(algorithm, data).hexdigest() != digest]


def check_shards(leaf: Location, entries: list[dict]) -> None:
    """Refuse to index a leaf whose shards are not all present and whole."""
    problems = shard_problems(leaf, entries)
    if problems:
        raise RuntimeError(f"not indexing {leaf}: {'; '.join(problems[:5])}")


def _written_here(staged: Path) -> list[Path]:
    """The folders of a staged version and the files written into it: a carried shard (a
    hard link of a published, flushed tree: more than one link) needs only its folder
    flushed (5,000 of them flushed one by one: 0.19 s here; a 10⁸-sample tree has ~10⁵)."""
    return sorted(path for path in staged.rglob("*")
                  if path.is_dir() or path.stat().st_nlink == 1)
