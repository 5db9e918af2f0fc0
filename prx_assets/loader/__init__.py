"""The training loader: weighted, shape-batched, skip-list-aware streaming of MDS trees.

Usable without Dagster:

    from prx_assets.loader import build_loader
    loader = build_loader("data/mds", tier=512, batch_size=32, seed=17)
    for batch in loader:            # {"image": uint8 (B, 3, H, W), "caption": [...], ...}
        ...
    state = loader.state_dict()     # mid-epoch resume: loader.load_state_dict(state)

See docs/mds.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

from streaming import StreamingDataLoader

from prx_assets.loader.collate import CaptionEncoder, ShapeBatchCollate
from prx_assets.loader.dataset import (
    LOCAL_PREDOWNLOAD, SkipListMismatch, SkipListStreamingDataset)
from prx_assets.loader.streams import Leaf, default_weights, leaf_streams, plan_leaves

__all__ = ["build_dataset", "build_loader", "SkipListStreamingDataset", "SkipListMismatch",
           "ShapeBatchCollate", "Leaf", "plan_leaves", "default_weights", "LOCAL_PREDOWNLOAD"]


def build_dataset(mds_root: str | Path, tier: int, batch_size: int, *,
                  weights: Optional[Mapping[str, float]] = None,
                  sources_file: Optional[Path] = None,
                  skip_reasons: Optional[Iterable[str]] = None, seed: int = 9176,
                  shuffle: bool = True, **kwargs: Any) -> SkipListStreamingDataset:
    """One stream per leaf of `tier` across the weighted sources' current trees.

    weights: per-source weights (default: `weight` in sources.yaml); skip_reasons: `None` for
    every reason in the sidecars. Extra kwargs go to `StreamingDataset`."""
    weights = dict(weights) if weights is not None else default_weights(sources_file)
    leaves = plan_leaves(Path(mds_root), tier, weights)
    return SkipListStreamingDataset(streams=leaf_streams(leaves), batch_size=batch_size,
                                    skip_reasons=skip_reasons, shuffle=shuffle,
                                    shuffle_seed=seed, **kwargs)


def build_loader(mds_root: str | Path, tier: int, batch_size: int, *,
                 encode_captions: Optional[CaptionEncoder] = None, num_workers: int = 0,
                 **dataset_kwargs: Any) -> StreamingDataLoader:
    """`build_dataset` wrapped in a StreamingDataLoader (which carries state_dict for resume)."""
    dataset = build_dataset(mds_root, tier, batch_size, **dataset_kwargs)
    return StreamingDataLoader(dataset, batch_size=batch_size, num_workers=num_workers,
                               collate_fn=ShapeBatchCollate(encode_captions),
                               persistent_workers=False)
