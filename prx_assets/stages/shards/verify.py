"""The `leaves_stream` check: every leaf of the current tree opened with a plain
`streaming.StreamingDataset`, its sample count compared with the mapping table plus the
stale samples of its sidecars; mapping rows of a version the tree does not hold reported.

A StreamingDataset counts a leaf from its `index.json` alone (shards are read lazily). A
remote leaf's index is fetched through its `Location` (the storage's own S3 client) into a
local folder the dataset opens: the check needs no credentials in any environment, and
streaming parses the same bytes it would have downloaded itself.

What a StreamingDataset counts depends on a leaf's index alone, so a count is kept per
index digest (`verified_leaves.json` beside the tree versions, per streaming release): a
check after an incremental build opens only the leaves whose index changed, and none (no
child process) when no index did. The mapping is counted per fragment, the counts kept
beside (`mapping.MAPPED_LEAVES`): a check after a small run scans the fragments it wrote
or deleted from. Shard files and sizes are checked for every leaf on every run.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prx_assets.stages.shards.mapping import MAPPED_LEAVES, mapped_leaves
from prx_assets.stages.shards.stream_counter import streamed_counts
from prx_assets.storage.layout import Storage, as_storage
from prx_assets.storage.leases import READER_TTL_S, ReaderLeaseKeeper, tree_lease
from prx_assets.storage.refs import Location
from prx_assets.storage.sidecars import REASON_STALE, SIDECAR_SUFFIX, read_sidecar
from prx_assets.storage.tables import MDS_SAMPLES
from prx_assets.storage.trees import (
    INDEX,
    TreeStore,
    hold_tree,
    leaf_names,
    lineage,
    shard_problems,
    tree_store,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LeafCheck:
    leaf: str
    streamed: int  # samples a plain StreamingDataset sees
    mapped: int  # rows of the mapping table for this leaf (live samples)
    stale: int = 0  # samples stored but skipped as stale (not in the mapping)

    @property
    def ok(self) -> bool:
        return self.streamed == self.mapped + self.stale


def verify_tree(storage: Storage | str | Path, source: str,
                log: Callable[[str], None] = logger.info) -> tuple[list[LeafCheck], list[str]]:
    """Count every leaf of the current tree as `streaming.StreamingDataset` does and compare
    with the mapping table plus the stale samples of its sidecars; also report mapping rows
    of a version the tree does not hold and shards the indexes list that are missing or of
    another size.

    The tree, the mapping and the sidecars are read under the source's tree lease, so no
    build, skip-list update or rewrite commits between those reads (a mapping read after
    another run's commit disagrees with the tree read before it), and the tree is held by a
    reader lease until its leaves are counted: another run's publish prunes superseded trees
    (the soak, retention 0, seed 307: a concurrent run's prune removed the tree mid-check and
    its stale samples read as none, failing the check)."""
    storage = as_storage(storage)
    store = tree_store(storage, source)
    keeper: ReaderLeaseKeeper | None = None
    try:
        with tree_lease(store.data_root, source, log=log):
            tree, reader = hold_tree(store, READER_TTL_S)
            keeper = ReaderLeaseKeeper([reader])  # renewed while a large tree is counted
            snapshot = _snapshot(storage, store, source, tree)
        streamed = counts_by_index(store, [tree / leaf for leaf in snapshot.leaves],
                                   snapshot.indexes)
    finally:
        if keeper is not None:
            keeper.release()
    mapped = snapshot.mapped
    checks = [LeafCheck(leaf, count, mapped.pop(leaf, 0), stale)
              for leaf, count, stale in zip(snapshot.leaves, streamed, snapshot.stale,
                                            strict=True)]
    checks += [LeafCheck(name, 0, n) for name, n in sorted(mapped.items())]  # no such leaf
    return checks, snapshot.problems


@dataclass
class _Snapshot:
    """What the check compares, read while no tree writer can commit."""

    leaves: list[str]
    indexes: list[bytes]
    stale: list[int]
    mapped: Counter
    problems: list[str]


def _snapshot(storage: Storage, store: TreeStore, source: str, tree: Location) -> _Snapshot:
    version = tree.name
    held = set(lineage(store.manifest(version) or {}, version))
    mapped, versions = mapped_leaves(storage.table(MDS_SAMPLES, source),
                                     cache=store.trees_dir / MAPPED_LEAVES)
    problems = sorted(f"mapping rows of tree {v}, current is {version}"
                      for v in versions if v not in held)
    leaves = leaf_names(tree)
    indexes = [(tree / leaf / INDEX).read_bytes() for leaf in leaves]
    # A StreamingDataset counts from the index alone: a missing or short shard fails only
    # when a trainer reaches it, so the files are checked against the index here.
    problems += [problem for leaf, index in zip(leaves, indexes, strict=True)
                 for problem in shard_problems(tree / leaf, json.loads(index)["shards"])]
    stale = [stale_in_leaf(tree / leaf) for leaf in leaves]
    return _Snapshot(leaves, indexes, stale, mapped, problems)

VERIFIED_LEAVES = "verified_leaves.json"  # in the source's trees folder


def counts_by_index(store: TreeStore, leaves: list[Location], indexes: list[bytes]
                    ) -> list[int]:
    """`leaf_stream_counts` of the leaves, opening only those whose index (by digest) no
    earlier check counted under this streaming release; the counts of the current leaves
    are kept for the next check."""
    digests = [hashlib.sha256(index).hexdigest() for index in indexes]
    known = read_verified(store)
    todo = [n for n, digest in enumerate(digests) if digest not in known]
    fresh = leaf_stream_counts([leaves[n] for n in todo])
    counts = known | {digests[n]: count for n, count in zip(todo, fresh, strict=True)}
    if todo or set(known) != set(digests):
        write_verified(store, {digest: counts[digest] for digest in digests})
    return [counts[digest] for digest in digests]


def streaming_release() -> str:
    return importlib.metadata.version("mosaicml-streaming")


def read_verified(store: TreeStore) -> dict[str, int]:
    """Index digest -> streamed count from earlier checks; nothing when absent, unreadable
    or written under another streaming release (every leaf is opened again then)."""
    try:
        saved = json.loads((store.trees_dir / VERIFIED_LEAVES).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(saved, dict) or saved.get("streaming") != streaming_release():
        return {}
    return {str(k): int(v) for k, v in saved.get("counts", {}).items()}


def write_verified(store: TreeStore, counts: dict[str, int]) -> None:
    (store.trees_dir / VERIFIED_LEAVES).write_text(json.dumps(
        {"streaming": streaming_release(), "counts": counts}, indent=1, sort_keys=True))


def stale_in_leaf(leaf: Location) -> int:
    return sum(len(read_sidecar(sidecar).get(REASON_STALE, []))
               for sidecar in leaf.files(SIDECAR_SUFFIX))


def leaf_stream_counts(leaves: list[Location]) -> list[int]:
    """`streamed_counts` of local or remote leaves (a remote leaf's index fetched first)."""
    if not leaves:
        return []
    with tempfile.TemporaryDirectory(prefix="prx-mds-check-") as scratch:
        folders = [leaf.path if leaf.is_local else _fetch_index(leaf, Path(scratch) / str(n))
                   for n, leaf in enumerate(leaves)]
        return streamed_counts([str(folder) for folder in folders])


def _fetch_index(leaf: Location, folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / INDEX).write_bytes((leaf / INDEX).read_bytes())
    return folder
