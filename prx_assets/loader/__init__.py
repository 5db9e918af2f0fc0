"""The training loader: weighted, shape-batched, skip-list-aware streaming of MDS trees.

Usable without Dagster:

    from prx_assets.loader import build_loader
    loader = build_loader(None, tier=512, batch_size=32, seed=17)  # None: $PRX_DATA_ROOT/mds
    for batch in loader:            # {"image": uint8 (B, 3, H, W), "caption": [...], ...}
        ...
    state = loader.state_dict()     # mid-epoch resume: loader.load_state_dict(state)

See docs/mds.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from streaming import StreamingDataLoader

from prx_assets.engine.shm_prefix import claiming_prefix
from prx_assets.loader.collate import CaptionEncoder, ShapeBatchCollate
from prx_assets.loader.dataset import (
    LOCAL_PREDOWNLOAD,
    OptOutGuard,
    SkipListMismatch,
    SkipListStreamingDataset,
)
from prx_assets.loader.streams import (
    Leaf,
    default_weights,
    hold_trees,
    leaf_streams,
    plan_leaves,
)
from prx_assets.stages.opt_outs.guard import places, recorded_opt_outs
from prx_assets.stages.opt_outs.rights import withheld_ids
from prx_assets.storage.layout import Storage
from prx_assets.storage.refs import Location, as_location

__all__ = [
    "LOCAL_PREDOWNLOAD",
    "Leaf",
    "OptOutGuard",
    "ShapeBatchCollate",
    "SkipListMismatch",
    "SkipListStreamingDataset",
    "build_dataset",
    "build_loader",
    "default_weights",
    "opt_out_guard",
    "plan_leaves",
]


def build_dataset(mds_root: Location | str | Path | None, tier: int, batch_size: int, *,
                  weights: Mapping[str, float] | None = None,
                  sources_file: Path | None = None,
                  skip_reasons: Iterable[str] | None = None, seed: int = 9176,
                  shuffle: bool = True, cache_dir: str | Path | None = None,
                  guard_opt_outs: bool = True, **kwargs: Any) -> SkipListStreamingDataset:
    """One stream per leaf of `tier` across the weighted sources' current trees.

    weights: per-source weights (default: `weight` in sources.yaml); skip_reasons: `None` for
    the reasons that apply by default (`skip_lists.DEFAULT_REASONS`: duplicates, labels,
    opt-outs; `stale` always applies); the opt-in `balance` (the balanced concept sample)
    and named ablation lists apply only when named here; mds_root: `None` for the configured
    storage's MDS root, a local folder or an `s3://` prefix, whose shards then stream into
    `cache_dir` (downloaded with the credentials of this process's environment). Extra
    kwargs go to `StreamingDataset`.

    Each source's tree is held by a reader lease, renewed while the dataset lives
    (`dataset.reader_leases`; `release()` it to let the trees go before the process ends):
    rebuilds meanwhile publish new trees, and this one stays until the epoch is done.

    Fail closed: every opt-out recorded (in `opt_outs/` under the storage root of
    `mds_root`) by the time the trees are opened, and every sample withheld for its rights
    (`stages.opt_outs.rights`: a reservation read at ingest, the domain list, no curator
    clearance), is skipped even where a sidecar is missing or stale;
    `guard_opt_outs=False` trusts the sidecars alone (benchmarks)."""
    weights = dict(weights) if weights is not None else default_weights(sources_file)
    storage = Storage(as_location(mds_root).parent.uri) if mds_root else Storage.from_env()
    root = as_location(mds_root) if mds_root else storage.mds_root
    trees, keeper = hold_trees(root, weights)
    try:
        leaves = plan_leaves(root, tier, weights, trees)
        if any(leaf.remote for leaf in leaves):
            kwargs.setdefault("predownload", None)  # streaming's default download throttle
        guard = opt_out_guard(storage, leaves) if guard_opt_outs else None
        dataset = claiming_prefix(lambda: SkipListStreamingDataset(
            streams=leaf_streams(leaves, cache_dir), batch_size=batch_size,
            skip_reasons=skip_reasons, shuffle=shuffle, shuffle_seed=seed, opt_outs=guard,
            **kwargs))
    except BaseException:
        keeper.release()
        raise
    dataset.reader_leases = keeper
    return dataset


def opt_out_guard(storage: Storage, leaves: list[Leaf]) -> OptOutGuard:
    """The opt-outs recorded now and the samples withheld for their rights, placed in the
    leaves just planned (one per stream)."""
    sources = {leaf.source for leaf in leaves}
    opted = set(recorded_opt_outs(storage))
    withheld = set(withheld_ids(storage, sources)) - opted
    if not opted and not withheld:
        return OptOutGuard()
    return OptOutGuard(ids=frozenset(opted), per_stream=_placed(storage, leaves, opted),
                       rights_ids=frozenset(withheld),
                       rights_per_stream=_placed(storage, leaves, withheld))


def _placed(storage: Storage, leaves: list[Leaf], ids: set[str]
            ) -> tuple[dict[str, list[int]], ...]:
    """Per leaf (stream), the shard-local indices of `ids` by shard file name."""
    if not ids:
        return ()
    per_leaf: dict[tuple[str, str], dict[str, list[int]]] = {}
    for source in {leaf.source for leaf in leaves}:
        for place in places(storage, source, ids):
            shards = per_leaf.setdefault((source, place.leaf), {})
            shards.setdefault(place.shard, []).append(place.sample_index)
    return tuple(per_leaf.get((leaf.source, _leaf_name(leaf)), {}) for leaf in leaves)


def _leaf_name(leaf: Leaf) -> str:
    """`<tier>/<W>x<H>`: the last two parts of the leaf's folder or prefix."""
    return "/".join(str(leaf.path).rstrip("/").split("/")[-2:])


def build_loader(mds_root: Location | str | Path | None, tier: int, batch_size: int, *,
                 encode_captions: CaptionEncoder | None = None, num_workers: int = 0,
                 **dataset_kwargs: Any) -> StreamingDataLoader:
    """`build_dataset` wrapped in a StreamingDataLoader (which carries state_dict for resume).

    Images travel as JPEG bytes and are decoded once, by the collate function (in workers)."""
    dataset_kwargs.setdefault("decode_images", False)
    dataset = build_dataset(mds_root, tier, batch_size, **dataset_kwargs)
    return StreamingDataLoader(dataset, batch_size=batch_size, num_workers=num_workers,
                               collate_fn=ShapeBatchCollate(encode_captions),
                               persistent_workers=False)
