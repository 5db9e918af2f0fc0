import gc
import io
import json
import os
import socket
import subprocess
import sys
import zlib
from collections import Counter
from pathlib import Path

import pytest
import torch
from PIL import Image

from prx_assets.loader import SkipListMismatch, build_dataset, build_loader
from prx_assets.stages.shards import mds, plan
from prx_assets.storage import trees
from prx_assets.storage.layout import Storage
from prx_assets.storage.sidecars import sidecar_path
from prx_assets.testing.mds_corpus import build_corpus, inputs_for
from prx_assets.testing.shared_memory import release_shared_memory

TIER, BATCH = 1, 4
SHAPES = ((1, 48, 48), (1, 48, 64), (1, 64, 48), (2, 64, 64))
WEIGHTS = {"alpha": 3.0, "beta": 1.0}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two sources' trees (several shards per leaf) with skip sidecars on some shards."""
    root = tmp_path_factory.mktemp("loader") / "data"
    options = plan.WriteOptions(size_limit=12_000, parallel=False)
    for seed, source in enumerate(WEIGHTS):
        build_corpus(root, source, per_shape=40, seed=seed, shapes=SHAPES)
        mds.write_mds_tree(inputs_for(root, source), root, source, options)
    mapping = {}
    for source in WEIGHTS:
        rows = Storage(root).table("mds_samples", source).to_table().to_pylist()
        mapping.update({(source, r["leaf"], r["shard"], r["sample_index"]): r["id"] for r in rows})
    skipped = {"dedup": set(), "nsfw": set()}
    for (source, leaf, shard, index), sample_id in mapping.items():
        reason = "dedup" if zlib.crc32(sample_id.encode()) % 7 == 0 else (
            "nsfw" if zlib.crc32(sample_id.encode()) % 11 == 0 else None)
        if reason:
            skipped[reason].add((source, leaf, shard, index))
    for reason, places in skipped.items():
        _write_sidecars(root / "mds", reason, places)
    return {"root": root / "mds", "mapping": mapping,
            "skipped": {r: {mapping[p] for p in places} for r, places in skipped.items()}}


def _write_sidecars(mds_root: Path, reason: str, places) -> None:
    by_shard: dict[Path, list[int]] = {}
    for source, leaf, shard, index in places:
        by_shard.setdefault(trees.current_tree(mds_root, source) / leaf / shard, []).append(index)
    for shard, indices in by_shard.items():
        path = sidecar_path(shard)
        lists = json.loads(path.read_text())["lists"] if path.exists() else {}
        lists[reason] = sorted(indices)
        path.write_text(json.dumps({"version": 1, "lists": lists}))


@pytest.fixture(autouse=True)
def fresh_shared_memory(tmp_path_factory):
    release_shared_memory(tmp_path_factory.getbasetemp())
    yield
    gc.collect()  # datasets release their shared memory on deletion
    release_shared_memory(tmp_path_factory.getbasetemp())


def _loader(corpus, **kwargs):
    kwargs.setdefault("weights", WEIGHTS)
    kwargs.setdefault("seed", 7)
    return build_loader(corpus["root"], TIER, BATCH, **kwargs)


def _epoch(loader, stop: int | None = None) -> list[list[str]]:
    batches = []
    for batch in loader:
        batches.append(batch["id"])
        if stop is not None and len(batches) == stop:
            break
    return batches


def test_same_seed_same_order_and_no_skipped_id(corpus):
    # Weights proportional to size (both sources are the same size): no upsampling repeats.
    even = {"alpha": 1.0, "beta": 1.0}
    loader = _loader(corpus, weights=even)
    first = _epoch(loader)
    assert len(loader) == len(first) and len(loader.dataset) == BATCH * len(first)
    del loader
    gc.collect()
    second = _epoch(_loader(corpus, weights=even))
    gc.collect()
    other_seed = _epoch(_loader(corpus, weights=even, seed=8))
    assert first == second and first != other_seed
    ids = [i for batch in first for i in batch]
    assert all(len(batch) == BATCH for batch in first)
    assert len(ids) == len(set(ids))  # nothing repeated to fill a batch
    skipped = corpus["skipped"]["dedup"] | corpus["skipped"]["nsfw"]
    assert skipped and not skipped & set(ids)
    tier_ids = {i for (s, leaf, _, _), i in corpus["mapping"].items() if leaf.startswith("1/")}
    kept = tier_ids - skipped
    assert set(ids) <= kept
    assert len(kept) - len(ids) < BATCH * 6  # trimmed to whole batches: < 1 batch per stream


def test_a_loader_started_beside_another_claims_the_next_prefix(corpus, claimed_meanwhile):
    dataset = build_dataset(corpus["root"], TIER, BATCH, weights=WEIGHTS, seed=7)
    assert claimed_meanwhile and dataset._shm_prefix_int not in claimed_meanwhile
    assert len(dataset) > 0
    dataset.reader_leases.release()
    del dataset


def test_one_shape_per_batch(corpus):
    for batch in _loader(corpus):
        shape = tuple(batch["image"].shape)
        assert batch["image"].dtype == torch.uint8 and shape[:2] == (BATCH, 3)
        leaves = {i.split(":")[1].split("-")[1] for i in batch["id"]}  # ids carry their shape
        assert leaves == {f"{shape[3]}x{shape[2]}"}


def test_resume_mid_epoch_equals_uninterrupted(corpus):
    whole = _epoch(_loader(corpus))
    gc.collect()
    interrupted = _loader(corpus)
    head = _epoch(interrupted, stop=5)
    state = interrupted.state_dict()
    del interrupted
    gc.collect()
    resumed = _loader(corpus)
    resumed.load_state_dict(state)
    assert head + _epoch(resumed) == whole


def test_resume_with_other_skip_lists_is_refused(corpus):
    loader = _loader(corpus)
    _epoch(loader, stop=2)
    state = loader.state_dict()
    assert state["prx_skip_reasons"] == ["dedup", "nsfw"]
    del loader
    gc.collect()
    other = _loader(corpus, skip_reasons=["dedup"])
    with pytest.raises(SkipListMismatch, match="skip reasons"):
        other.load_state_dict(state)
    del other
    gc.collect()
    same_reasons = _loader(corpus, skip_reasons=["nsfw", "dedup"])
    same_reasons.load_state_dict(state)  # same lists: accepted


@pytest.mark.e2e  # ranks in subprocesses
def test_ranks_and_workers_get_equal_disjoint_batches(corpus):
    """Two ranks on one node (real processes, gloo), each with two DataLoader workers;
    weights proportional to size, so no sample is upsampled (repeated)."""
    port = _free_port()
    ranks = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "PYTHONPATH": os.getcwd()}
        ranks.append(subprocess.Popen(
            [sys.executable, "-m", "prx_assets.testing.rank_main", str(corpus["root"]),
             str(TIER), str(BATCH), "2"], env=env, stdout=subprocess.PIPE))
    outputs = [rank.communicate(timeout=300)[0] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0]
    per_rank = [json.loads(out.decode().strip().splitlines()[-1]) for out in outputs]
    assert len(per_rank[0]) == len(per_rank[1]) > 0
    assert all(len(batch) == BATCH for batches in per_rank for batch in batches)
    ids = [[i for batch in batches for i in batch] for batches in per_rank]
    assert not set(ids[0]) & set(ids[1])
    skipped = corpus["skipped"]["dedup"] | corpus["skipped"]["nsfw"]
    assert not skipped & (set(ids[0]) | set(ids[1]))
    for a, b in zip(*per_rank, strict=True):  # the same step on both ranks has one shape
        assert a[0].split("-")[1] == b[0].split("-")[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_source_weights_are_honoured(corpus):
    # Iterating the dataset itself (no DataLoader): this rank's samples of one epoch.
    dataset = build_dataset(corpus["root"], TIER, BATCH, weights=WEIGHTS, seed=3,
                            skip_reasons=())
    counts = Counter(sample["source"] for sample in dataset)
    share = counts["alpha"] / sum(counts.values())
    assert share == pytest.approx(0.75, abs=0.05)


class TinyTextEncoder(torch.nn.Module):
    """Hashes words into a small embedding bag: a real (if tiny) model, deterministic."""

    def __init__(self, dim: int = 8):
        super().__init__()
        torch.manual_seed(0)
        self.bag = torch.nn.EmbeddingBag(257, dim, mode="mean")

    def forward(self, captions: list[str]) -> torch.Tensor:
        tokens = [torch.tensor([zlib.crc32(w.encode()) % 257 for w in c.split()]) for c in captions]
        offsets = torch.tensor([0] + [len(t) for t in tokens[:-1]]).cumsum(0)
        with torch.no_grad():
            return self.bag(torch.cat(tokens), offsets)


def test_caption_hook_encodes_each_batch(corpus):
    encoder = TinyTextEncoder()
    batch = next(iter(_loader(corpus, encode_captions=encoder)))
    assert batch["caption_latents"].shape == (BATCH, 8)
    assert torch.equal(batch["caption_latents"], encoder(batch["caption"]))


def test_direct_local_reads_match_the_base_iterator(corpus):
    from streaming import StreamingDataset

    def samples(iterate):
        dataset = build_dataset(corpus["root"], TIER, BATCH, weights=WEIGHTS, seed=5)
        out = [(s["id"], s["caption"], s["image"].tobytes()) for s in iterate(dataset)]
        del dataset
        gc.collect()
        return out

    direct = samples(iter)
    assert direct and direct == samples(StreamingDataset.__iter__)

    dataset = build_dataset(corpus["root"], TIER, BATCH, weights=WEIGHTS, seed=5,
                            decode_images=False)
    raw = [(s["id"], s["caption"], Image.open(io.BytesIO(s["image"])).tobytes())
           for s in dataset]
    assert raw == direct
