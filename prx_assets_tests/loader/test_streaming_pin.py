"""The loader leans on internals of mosaicml-streaming's StreamingDataset (pinned <0.14 in
pyproject.toml): it overrides `resample_streams`, `state_dict`, `load_state_dict` and
`__iter__`, and calls `_resume_incr_epoch`, `_get_work`, the rank worlds and the shard
readers' fields directly. A streaming release that moves any of them must fail here, by
name, before it fails as a wrong sample order or a resume that replays samples."""

from __future__ import annotations

import inspect

import pytest
import streaming
from streaming import MDSWriter, StreamingDataset

from prx_assets.engine.shm_prefix import claiming_prefix
from prx_assets.loader.dataset import SkipListStreamingDataset

# Method -> the parameters (after self) the loader passes or receives, in order.
METHODS = {
    "resample_streams": ["epoch", "stream_id"],  # overridden
    "state_dict": ["num_samples", "from_beginning"],  # overridden
    "load_state_dict": ["obj"],  # overridden
    "__iter__": [],  # overridden
    "_resume_incr_epoch": [],  # called: -> (epoch, sample_in_epoch)
    "_get_work": ["epoch", "sample_in_epoch"],  # called: -> this worker's sample ids
}
INIT_KEYWORDS = ["streams", "batch_size", "batching_method", "shuffle", "shuffle_seed",
                 "predownload", "num_canonical_nodes"]
DATASET_ATTRIBUTES = ["_unique_rank_world", "_parallel_rank_world", "shards", "streams",
                      "sample_offset_per_shard", "num_canonical_nodes", "shuffle_seed",
                      "num_streams", "num_samples", "batch_size"]
WORLD_ATTRIBUTES = ["num_nodes", "ranks_per_node", "num_ranks"]
SHARD_ATTRIBUTES = ["dirname", "split", "raw_data", "zip_data", "samples", "column_names",
                    "column_encodings", "column_sizes", "decode_sample"]


def _changed(what: str) -> str:
    return (f"mosaicml-streaming {streaming.__version__}: {what}; "
            "prx_assets/loader/dataset.py (SkipListStreamingDataset) relies on it. Review the "
            "loader against the new StreamingDataset before moving the pin in pyproject.toml")


@pytest.mark.parametrize("name", sorted(METHODS))
def test_overridden_and_called_methods_keep_their_signature(name):
    method = getattr(StreamingDataset, name, None)
    assert callable(method), _changed(f"StreamingDataset.{name} is gone")
    params = [p for p in inspect.signature(method).parameters if p != "self"]
    assert params == METHODS[name], _changed(
        f"StreamingDataset.{name} now takes ({', '.join(params)}), "
        f"expected ({', '.join(METHODS[name])})")


def test_constructor_keywords_the_loader_passes():
    params = inspect.signature(StreamingDataset.__init__).parameters
    missing = [k for k in INIT_KEYWORDS if k not in params]
    assert not missing, _changed(f"StreamingDataset() no longer takes {missing}")


def test_mds_decode_is_where_the_loader_imports_it():
    try:
        from streaming.base.format.mds.encodings import mds_decode
    except ImportError as exc:
        pytest.fail(_changed(f"streaming.base.format.mds.encodings.mds_decode: {exc}"))
    assert list(inspect.signature(mds_decode).parameters) == ["encoding", "data"], \
        _changed("mds_decode(encoding, data) changed its parameters")


def test_dataset_world_and_shard_fields_the_loader_reads(tmp_path):
    leaf = tmp_path / "leaf"
    with MDSWriter(columns={"id": "str"}, out=str(leaf)) as writer:
        for i in range(4):
            writer.write({"id": str(i)})
    dataset = claiming_prefix(lambda: SkipListStreamingDataset(
        streams=[streaming.Stream(local=str(leaf))], batch_size=2, shuffle=False))
    missing = [a for a in DATASET_ATTRIBUTES if not hasattr(dataset, a)]
    assert not missing, _changed(f"a StreamingDataset has no {missing}")
    world = dataset._parallel_rank_world
    missing = [a for a in WORLD_ATTRIBUTES if not hasattr(world, a)]
    assert not missing, _changed(f"its rank World has no {missing}")
    assert callable(getattr(dataset._unique_rank_world, "detect_workers", None)), \
        _changed("World.detect_workers is gone")
    missing = [a for a in SHARD_ATTRIBUTES if not hasattr(dataset.shards[0], a)]
    assert not missing, _changed(f"an MDS shard reader has no {missing}")
    assert sorted(s["id"] for s in dataset) == ["0", "1", "2", "3"]
