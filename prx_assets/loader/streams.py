"""Streams for the loader: one per leaf (tier, shape) of each source's current MDS tree,
local or on an object store (a remote stream with a local cache folder)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from streaming import Stream

from prx_assets.stages.ingest.sources import load_sources
from prx_assets.stages.shards.mds import read_index
from prx_assets.stages.shards.trees import TreeStore, leaf_names
from prx_assets.storage import object_store

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
        return object_store.is_object_store(self.path)


def default_weights(sources_file: Path | None = None) -> dict[str, float]:
    """Per-source weights from sources.yaml (`weight`, default 1.0); zero weights dropped."""
    return {s.name: s.weight for s in load_sources(sources_file).sources if s.weight > 0}


def plan_leaves(mds_root: Path | str, tier: int, weights: Mapping[str, float]) -> list[Leaf]:
    """Each source's weight split across its leaves of `tier` by their sample counts.

    `mds_root` is `$PRX_DATA_ROOT/mds`: a local folder or an s3:// prefix (its current
    trees found through the pointer objects). Proportions sum to 1; a source with no tree or
    no samples at this tier is an error when it was asked for by weight, since silently
    training without it changes the mix."""
    if not weights or sum(weights.values()) <= 0:
        raise ValueError("weights must name at least one source with a positive weight")
    root = object_store.as_uri(mds_root)
    if not object_store.is_object_store(root):
        root = str(Path(root).resolve())
    total_weight = float(sum(weights.values()))
    leaves: list[Leaf] = []
    for source, weight in sorted(weights.items()):
        if weight <= 0:
            continue
        tree = _current_tree(root, source)
        counted = [(path, sum(s["samples"] for s in read_index(str(path))))
                   for path in _tier_leaves(root, source, tree, tier)]
        counted = [(path, n) for path, n in counted if n > 0]
        source_samples = sum(n for _, n in counted)
        if not source_samples:
            raise ValueError(f"source {source!r} has no samples at tier {tier} in {tree}")
        leaves += [Leaf(source, path, n, weight / total_weight * n / source_samples)
                   for path, n in counted]
    return leaves


def _current_tree(root: str, source: str) -> str:
    if object_store.is_object_store(root):
        return TreeStore(root, source).current_tree()
    from prx_assets.stages.shards.mds import current_tree

    return str(current_tree(Path(root), source))


def _tier_leaves(root: str, source: str, tree: str, tier: int) -> list[Path | str]:
    names = [n for n in leaf_names(TreeStore(root, source), tree) if n.split("/")[0] == str(tier)]
    if object_store.is_object_store(tree):
        return [f"{tree}/{name}" for name in names]
    return [Path(tree) / name for name in names]


def leaf_streams(leaves: list[Leaf], cache_dir: Path | str | None = None) -> list[Stream]:
    """Local leaves are read in place; remote ones stream into `cache_dir` (default: a
    folder under the system temp dir), one subfolder per leaf and tree version, so a cache
    never mixes two versions' shards."""
    cache = Path(cache_dir or DEFAULT_CACHE)
    streams = []
    for leaf in leaves:
        if leaf.remote:
            _, bucket, key = object_store.split_uri(str(leaf.path))
            streams.append(Stream(remote=str(leaf.path), local=str(cache / bucket / key),
                                  proportion=leaf.proportion))
        else:
            streams.append(Stream(local=str(leaf.path), proportion=leaf.proportion))
    return streams


def use_remote_settings(mds_root: str) -> None:
    """mosaicml-streaming downloads with boto3 from the environment; it reads
    S3_ENDPOINT_URL, so the standard AWS_ENDPOINT_URL is passed on under that name too."""
    for name, value in object_store.streaming_env(mds_root).items():
        os.environ.setdefault(name, value)
