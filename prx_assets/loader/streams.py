"""Streams for the loader: one per leaf (tier, shape) of each source's current MDS tree,
local or on an object store (a remote stream with a local cache folder).

Trees are resolved and their indexes read through `Location` handles; the shards of a
remote stream are downloaded by mosaicml-streaming's own boto3 client, which reads the
trainer's environment as it is (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
`AWS_ENDPOINT_URL`, profiles): the loader sets no variable.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from streaming import Stream

from prx_assets.stages.ingest.sources import load_sources
from prx_assets.stages.subsets.tree import SUBSETS_DIR, subset_store
from prx_assets.storage.layout import MDS_DIR
from prx_assets.storage.leases import READER_TTL_S, ReaderLeaseKeeper
from prx_assets.storage.object_store import is_object_store, split_uri
from prx_assets.storage.refs import Location, as_location
from prx_assets.storage.trees import (
    TreeStore,
    hold_tree,
    leaf_names,
    leaf_samples,
    source_trees,
)

# A weight's key naming a subset's tree rather than a source's: `subset:<name>`.
SUBSET_PREFIX = "subset:"
DEFAULT_CACHE = Path(tempfile.gettempdir()) / "prx-mds-cache"


@dataclass(frozen=True)
class Leaf:
    source: str
    # Inside the tree resolved once: a later swap does not change what we read. A local
    # folder, or the leaf's s3:// prefix.
    path: Path | str
    samples: int
    proportion: float

    @property
    def remote(self) -> bool:
        return is_object_store(self.path)


def default_weights(sources_file: Path | None = None) -> dict[str, float]:
    """Per-source weights from sources.yaml (`weight`, default 1.0); zero weights dropped."""
    return {s.name: s.weight for s in load_sources(sources_file).sources if s.weight > 0}


def stream_trees(root: Location, key: str) -> TreeStore:
    """The trees a weight names: a source's, or with `subset:NAME` a subset's
    (`mds/subsets/NAME`); `root` is the MDS root or, locally, the data root above it."""
    if not key.startswith(SUBSET_PREFIX):
        return source_trees(root, key)
    if root.is_local and not os.path.lexists(root.path / SUBSETS_DIR) \
            and os.path.lexists(root.path / MDS_DIR / SUBSETS_DIR):
        root = root / MDS_DIR
    return subset_store(root, key.removeprefix(SUBSET_PREFIX))


def plan_leaves(mds_root: Location | Path | str, tier: int, weights: Mapping[str, float],
                trees: Mapping[str, Location] | None = None) -> list[Leaf]:
    """Each source's weight split across its leaves of `tier` by their sample counts.

    `mds_root` is `$PRX_DATA_ROOT/mds`: a local folder or an s3:// prefix (its current
    trees found through the pointer objects; `trees`: sources' trees already resolved, e.g.
    under a reader lease). Proportions sum to 1; a source with no tree or
    no samples at this tier is an error when it was asked for by weight, since silently
    training without it changes the mix."""
    if not weights or sum(weights.values()) <= 0:
        raise ValueError("weights must name at least one source with a positive weight")
    root = as_location(mds_root)
    total_weight = float(sum(weights.values()))
    leaves: list[Leaf] = []
    for source, weight in sorted(weights.items()):
        if weight <= 0:
            continue
        tree = trees[source] if trees and source in trees \
            else stream_trees(root, source).current_tree()
        counted = [(tree / name, leaf_samples(tree / name)) for name in leaf_names(tree)
                   if name.split("/")[0] == str(tier)]
        counted = [(leaf, n) for leaf, n in counted if n > 0]
        source_samples = sum(n for _, n in counted)
        if not source_samples:
            raise ValueError(f"source {source!r} has no samples at tier {tier} in {tree}")
        leaves += [Leaf(source, leaf.path if leaf.is_local else leaf.uri, n,
                        weight / total_weight * n / source_samples) for leaf, n in counted]
    return leaves


def hold_trees(mds_root: Location | Path | str, weights: Mapping[str, float],
               seconds: float = READER_TTL_S) -> tuple[dict[str, Location], ReaderLeaseKeeper]:
    """Each weighted source's (or subset's) current tree under a reader lease, renewed while
    the returned keeper lives (its thread renews every third of `seconds`); a tree is not
    pruned while held (docs/factory.md, "Reader leases and retention"). A reader that may not write
    (read-only credentials) streams without a lease, warned: the tree is then kept for the
    retention window only."""
    root = as_location(mds_root)
    trees: dict[str, Location] = {}
    leases = []
    for source, weight in sorted(weights.items()):
        if weight <= 0:
            continue
        try:
            trees[source], lease = hold_tree(stream_trees(root, source), seconds)
            leases.append(lease)
        except FileNotFoundError:
            raise  # no tree at all: the error names the source
        except OSError as exc:  # refused (read-only credentials, a read-only folder)
            warnings.warn(f"{source}: no reader lease ({exc}); the tree is kept only for its "
                          "retention window after a rebuild supersedes it", stacklevel=2)
            trees[source] = stream_trees(root, source).current_tree()
    return trees, ReaderLeaseKeeper(leases, seconds)


def leaf_streams(leaves: list[Leaf], cache_dir: Path | str | None = None) -> list[Stream]:
    """Local leaves are read in place; remote ones stream into `cache_dir` (default: a
    folder under the system temp dir), one subfolder per leaf and tree version, so a cache
    never mixes two versions' shards."""
    cache = Path(cache_dir or DEFAULT_CACHE)
    streams = []
    for leaf in leaves:
        if leaf.remote:
            _, bucket, key = split_uri(str(leaf.path))
            streams.append(Stream(remote=str(leaf.path), local=str(cache / bucket / key),
                                  proportion=leaf.proportion))
        else:
            streams.append(Stream(local=str(leaf.path), proportion=leaf.proportion))
    return streams
