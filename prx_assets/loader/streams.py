"""Streams for the loader: one per leaf (tier, shape) of each source's current MDS tree."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from streaming import Stream

from prx_assets.s7_shards.mds import current_tree, leaf_samples, tree_leaves
from prx_assets.s1_ingest.sources import load_sources


@dataclass(frozen=True)
class Leaf:
    source: str
    path: Path  # inside the tree resolved once: a later swap does not change what we read
    samples: int
    proportion: float


def default_weights(sources_file: Path | None = None) -> dict[str, float]:
    """Per-source weights from sources.yaml (`weight`, default 1.0); zero weights dropped."""
    return {s.name: s.weight for s in load_sources(sources_file).sources if s.weight > 0}


def plan_leaves(mds_root: Path, tier: int, weights: Mapping[str, float]) -> list[Leaf]:
    """Each source's weight split across its leaves of `tier` by their sample counts.

    Proportions sum to 1; a source with no tree or no samples at this tier is an error when
    it was asked for by weight, since silently training without it changes the mix."""
    if not weights or sum(weights.values()) <= 0:
        raise ValueError("weights must name at least one source with a positive weight")
    total_weight = float(sum(weights.values()))
    leaves: list[Leaf] = []
    for source, weight in sorted(weights.items()):
        if weight <= 0:
            continue
        tree = current_tree(mds_root, source)
        counted = [(path, leaf_samples(path)) for path in tree_leaves(tree, tier)]
        counted = [(path, n) for path, n in counted if n > 0]
        source_samples = sum(n for _, n in counted)
        if not source_samples:
            raise ValueError(f"source {source!r} has no samples at tier {tier} in {tree}")
        leaves += [Leaf(source, path, n, weight / total_weight * n / source_samples)
                   for path, n in counted]
    return leaves


def leaf_streams(leaves: list[Leaf]) -> list[Stream]:
    return [Stream(local=str(leaf.path), proportion=leaf.proportion) for leaf in leaves]
