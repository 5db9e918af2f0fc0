"""A StreamingDataset that applies skip lists before partitioning.

Skipped samples are removed where mosaicml-streaming resamples each stream (before the
epoch is partitioned over nodes, ranks and workers), not where samples are yielded. So a
skipped sample is never yielded, every rank still gets the same number of full batches, and
the order is a pure function of (seed, epoch, skip lists): determinism and mid-epoch resume
work as in the base class. Each stream's kept samples are trimmed (a seeded choice) to a
multiple of the global batch, so no batch is padded with -1 and no sample repeats to fill
one. A stream left without a whole global batch (a leaf whose every sample is skipped, or
too few kept) gives no batch: streaming's own per-stream batching divides by zero on an empty
stream and refuses a short one, so the epoch is made over the other streams (`BATCHING`),
in the order it would have had without them. The skip reasons and a digest of the skipped
set travel in the state dict; resuming with other lists is refused.

Local, uncompressed shards (what mds_shards writes) are read straight from memory-mapped
files in this worker's sample order: the base class's download and ready threads, its
per-sample file open and its shard-state bookkeeping exist for remote shards and cost more
than the read itself here. Samples are decoded by the shard readers exactly as the base
class does.
"""

from __future__ import annotations

import hashlib
import math
import mmap
import os
from collections import Counter, OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
from numpy.typing import NDArray
from streaming import StreamingDataset
from streaming.base.batching import batching_methods
from streaming.base.batching.per_stream import generate_work_per_stream_batching
from streaming.base.format.base.reader import JointReader
from streaming.base.world import World

from prx_assets.storage.leases import ReaderLeaseKeeper
from prx_assets.storage.refs import Location
from prx_assets.storage.sidecars import (
    REASON_STALE,
    SIDECAR_SUFFIX,
    applies_by_default,
    read_sidecar,
    sidecar_name,
    sidecar_path,
)

OPEN_SHARDS = 64  # memory maps kept open per worker (least recently used closed first)
# mosaicml-streaming's default predownload (8 x batch) makes the ready thread sleep in 7 ms
# ticks once it is that far ahead: ~1k samples/s on local disk. Local shards need no download
# throttle; prefetching far ahead costs nothing but a counter.
LOCAL_PREDOWNLOAD = 1 << 20
STATE_REASONS = "prx_skip_reasons"
STATE_DIGEST = "prx_skip_digest"
BATCHING = "prx_per_stream_whole_batches"  # registered with streaming below


@dataclass(frozen=True)
class OptOutGuard:
    """Opt-outs the loader drops whatever the sidecars say (a missing or stale sidecar
    must not leak one): per stream, the shard-local indices of the opted-out samples by
    shard file name, and every opted-out id, checked again on each sample yielded in case
    the mapping that placed them is older than the tree. The samples withheld for their
    rights (and not opted out) are held apart, `rights_*`, to be counted apart."""

    ids: frozenset[str] = frozenset()
    per_stream: tuple[Mapping[str, Sequence[int]], ...] = ()
    rights_ids: frozenset[str] = frozenset()
    rights_per_stream: tuple[Mapping[str, Sequence[int]], ...] = ()


class SkipListMismatch(ValueError):
    """A checkpoint was taken with other skip lists than the ones this dataset applies."""


class SkipListStreamingDataset(StreamingDataset):
    """StreamingDataset + skip lists, with one shape per batch (`per_stream` batching).

    Args:
        streams: one `streaming.Stream` per leaf (see `prx_assets.loader.build_dataset`).
        batch_size: per-device batch size (required: batches are formed per stream).
        skip_reasons: reasons to apply; `None` applies the reasons found in the sidecars that
            apply by default (`skip_lists.DEFAULT_REASONS`; the opt-in `balance` and named
            ablation lists are applied only when named), `()` applies none but
            `stale` (samples an incremental mds_shards run superseded,
            always applied: they are no longer part of the source).
        shuffle_seed: the seed of the deterministic shuffle.
        decode_images: False yields the `jpeg` columns as their stored bytes (local shards),
            leaving the decode to the collate function (one decode per image either way).
        opt_outs: recorded opt-outs skipped whatever the sidecars and `skip_reasons` say
            (see `OptOutGuard`); `build_dataset` reads them when it opens the trees.
        **kwargs: passed to `StreamingDataset` (e.g. `num_canonical_nodes`, `shuffle_algo`).
    """

    def __init__(self, *, streams, batch_size: int, skip_reasons: Iterable[str] | None = None,
                 shuffle: bool = True, shuffle_seed: int = 9176,
                 predownload: int | None = LOCAL_PREDOWNLOAD, decode_images: bool = True,
                 opt_outs: OptOutGuard | None = None, **kwargs: Any) -> None:
        super().__init__(streams=streams, batch_size=batch_size, batching_method="per_stream",
                         shuffle=shuffle, shuffle_seed=shuffle_seed, predownload=predownload,
                         **kwargs)
        self.batching_method = BATCHING  # per-stream, over the streams that fill a batch
        self.decode_images = decode_images
        self.opt_outs = opt_outs or OptOutGuard()
        wanted = None if skip_reasons is None else frozenset(skip_reasons) | {REASON_STALE}
        self.skipped, found = self._read_skip_lists(wanted)
        # Opted-out and withheld samples no sidecar skipped: the guard skips them (counted,
        # for a check; a sample both opted out and withheld counts as an opt-out).
        self.opt_outs_guarded = self._apply_opt_out_guard(self.opt_outs.per_stream)
        self.rights_guarded = self._apply_opt_out_guard(self.opt_outs.rights_per_stream)
        # Yielded samples the guard caught by id (a mapping older than the tree).
        self.opt_outs_dropped = self.rights_dropped = 0
        self.skip_reasons: list[str] = sorted(
            {r for r in found if applies_by_default(r)} if wanted is None
            else {r for r in wanted if r != REASON_STALE or r in found})
        self.skip_counts: Counter = found
        self.skip_digest = hashlib.sha256(np.flatnonzero(self.skipped).tobytes()).hexdigest()[:16]
        self.length = self._samples_per_rank(epoch=0)  # what len() and len(DataLoader) report
        # Set by `build_dataset`: the reader leases on the trees streamed, renewed meanwhile.
        self.reader_leases: ReaderLeaseKeeper | None = None

    @property
    def joint_shards(self) -> list[JointReader]:
        """The shard readers: MDS shards are joint (samples and their offsets in one file)."""
        return cast("list[JointReader]", self.shards)

    # ----------------------------------------------------------------------- skip lists
    def _read_skip_lists(self, wanted: frozenset[str] | None
                         ) -> tuple[NDArray[np.bool_], Counter]:
        """A mask over global sample ids, and how many samples each found reason skips."""
        skipped = np.zeros(self.num_samples, np.bool_)
        found: Counter = Counter()
        remote_sidecars = self._remote_sidecars()
        for shard_id, shard in enumerate(self.joint_shards):
            stream = self.streams[int(self.stream_per_shard[shard_id])]
            if stream.remote:
                name = sidecar_name(shard.raw_data.basename)
                sidecar = remote_sidecars[stream.remote].get(name)
                path = f"{stream.remote.rstrip('/')}/{name}"
                lists = read_sidecar(sidecar) if sidecar else {}
            else:
                path = str(sidecar_path(f"{shard.dirname}/{shard.split}/{shard.raw_data.basename}"))
                lists = read_sidecar(path)
            offset = int(self.sample_offset_per_shard[shard_id])
            for reason, indices in lists.items():
                found[reason] += len(indices)
                if applies_by_default(reason) if wanted is None else (reason in wanted):
                    local = np.asarray(indices, np.int64)
                    if local.size and (local.min() < 0 or local.max() >= shard.samples):
                        raise ValueError(f"{path}: index out of range for {shard.samples} samples")
                    skipped[offset + local] = True
        return skipped, found

    def _apply_opt_out_guard(self, per_stream: Sequence[Mapping[str, Sequence[int]]]) -> int:
        """Mark the guard's samples (`per_stream`) skipped; how many no sidecar (or earlier
        call) had skipped."""
        if not per_stream:
            return 0
        newly = 0
        for shard_id, shard in enumerate(self.joint_shards):
            stream = int(self.stream_per_shard[shard_id])
            indices = per_stream[stream].get(shard.raw_data.basename)
            if not indices:
                continue
            local = np.asarray([i for i in indices if 0 <= i < shard.samples], np.int64)
            if local.size:
                places = int(self.sample_offset_per_shard[shard_id]) + local
                newly += int(np.count_nonzero(~self.skipped[places]))
                self.skipped[places] = True
        return newly

    def _remote_sidecars(self) -> dict[str, dict[str, Location]]:
        """Per remote stream, the sidecars that exist by name: one listing per leaf instead
        of one request per shard (most shards have none). Read with the settings of this
        process's environment, as the shards are."""
        return {stream.remote: {sidecar.name: sidecar for sidecar
                                in Location.of(stream.remote).files(SIDECAR_SUFFIX)}
                for stream in self.streams if stream.remote}

    def resample_streams(self, epoch: int, stream_id: int | None = None
                         ) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        units, sample_ids = super().resample_streams(epoch, stream_id)
        units, sample_ids = _drop(units, sample_ids, ~self.skipped[sample_ids])
        if stream_id is not None:  # per-stream batching: whole global batches only
            multiple = self._samples_multiple(self._parallel_worker_world)
            excess = len(sample_ids) % multiple
            if excess:
                rng = np.random.default_rng([self.shuffle_seed, epoch, stream_id])
                keep = np.ones(len(sample_ids), np.bool_)
                keep[rng.choice(len(sample_ids), excess, replace=False)] = False
                units, sample_ids = _drop(units, sample_ids, keep)
        return units, sample_ids

    def _samples_multiple(self, world) -> int:
        """Stream sizes that partition into full global batches with no repeats or padding."""
        nodes = math.lcm(int(self.num_canonical_nodes or world.num_nodes), world.num_nodes)
        return nodes * world.ranks_per_node * int(self.batch_size or 1)  # never None: required here

    def _samples_per_rank(self, epoch: int) -> int:
        """Samples each rank yields in `epoch` (the base class counts skipped ones too)."""
        world = self._parallel_rank_world
        multiple = self._samples_multiple(world)
        total = 0
        for stream_id in range(self.num_streams):
            _, sample_ids = StreamingDataset.resample_streams(self, epoch, stream_id)
            kept = int(np.count_nonzero(~self.skipped[sample_ids]))
            total += kept - kept % multiple
        return total // world.num_ranks

    # ----------------------------------------------------------------------- reading
    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self.skipped.all():  # every sample skipped (removed, opted out): an empty epoch,
            return  # where streaming's partitioning of no samples divides by zero
        samples = self._samples()
        if not (self.opt_outs.ids or self.opt_outs.rights_ids):
            yield from samples
            return
        opted, withheld = self.opt_outs.ids, self.opt_outs.rights_ids
        for sample in samples:  # caught here only where the mapping was older than the tree
            if sample["id"] in opted:
                self.opt_outs_dropped += 1
            elif sample["id"] in withheld:
                self.rights_dropped += 1
            else:
                yield sample

    def _samples(self) -> Iterator[dict[str, Any]]:
        if not self._local_uncompressed():
            yield from super().__iter__()
            return
        # The base class's epoch bookkeeping (resume, epoch counter, partition), then a
        # direct read of this worker's samples.
        self._unique_worker_world = self._unique_rank_world.detect_workers()
        self._parallel_worker_world = self._parallel_rank_world.detect_workers()
        epoch, sample_in_epoch = self._resume_incr_epoch()
        sample_ids = self._get_work(epoch, sample_in_epoch)
        yield from self._read_local(sample_ids[sample_ids >= 0])

    def _local_uncompressed(self) -> bool:
        return (all(stream.remote is None for stream in self.streams)
                and all(shard.zip_data is None for shard in self.joint_shards))

    def _read_local(self, sample_ids: NDArray[np.int64]) -> Iterator[dict[str, Any]]:
        offsets = self.sample_offset_per_shard
        shard_ids = np.searchsorted(offsets, sample_ids, side="right") - 1
        local_ids = sample_ids - offsets[shard_ids]
        maps = _ShardMaps(self.shards, OPEN_SHARDS)
        try:
            for shard_id, index in zip(shard_ids.tolist(), local_ids.tolist(), strict=True):
                shard, data = self.shards[shard_id], maps.sample(shard_id, index)
                yield (shard.decode_sample(data) if self.decode_images
                       else _jpeg_as_bytes(shard, data))
        finally:
            maps.close()

    # ----------------------------------------------------------------------- resume
    def state_dict(self, num_samples: int, from_beginning: bool) -> dict[str, Any]:
        state = super().state_dict(num_samples, from_beginning)
        state[STATE_REASONS] = self.skip_reasons
        state[STATE_DIGEST] = self.skip_digest
        return state

    def load_state_dict(self, obj: dict[str, Any]) -> None:
        reasons = obj.get(STATE_REASONS)
        if reasons is None:
            raise SkipListMismatch("this state dict records no skip lists; it was not written "
                                   "by SkipListStreamingDataset, refusing to resume from it")
        if sorted(reasons) != self.skip_reasons:
            raise SkipListMismatch(
                f"checkpoint was taken with skip reasons {sorted(reasons)}, this dataset applies "
                f"{self.skip_reasons}; resuming would replay or drop samples. Use the same "
                "skip_reasons, or start a new epoch without load_state_dict")
        if obj.get(STATE_DIGEST) != self.skip_digest:
            raise SkipListMismatch(
                f"skip lists for reasons {self.skip_reasons} changed since the checkpoint "
                f"(digest {obj.get(STATE_DIGEST)} -> {self.skip_digest}); the sample order "
                "would differ, refusing to resume mid-epoch")
        super().load_state_dict(obj)


class _StreamsWithBatches:
    """The dataset as streaming's per-stream batching sees it, less the streams that fill no
    global batch once their skipped samples are dropped; each stream resampled once."""

    def __init__(self, dataset: StreamingDataset, epoch: int) -> None:
        resampled = [dataset.resample_streams(epoch, i) for i in range(dataset.num_streams)]
        kept = [i for i, (_, sample_ids) in enumerate(resampled) if len(sample_ids)]
        self._dataset = dataset
        self.streams = [dataset.streams[i] for i in kept]
        self._resampled = [resampled[i] for i in kept]

    def resample_streams(self, epoch: int, stream_id: int
                         ) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        return self._resampled[stream_id]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dataset, name)


def per_stream_whole_batches(dataset: StreamingDataset, world: World, epoch: int,
                             sample_in_epoch: int) -> NDArray[np.int64]:
    """streaming's per-stream batching over the streams that fill a global batch. Streams
    with no batch add nothing to its order (their batch count is 0), so the others' batches
    come in the order they would have with them."""
    view = _StreamsWithBatches(dataset, epoch)
    if not view.streams:  # no batch at all: the empty epoch, in the shape streaming expects
        return np.full((world.num_nodes, world.ranks_per_node, world.workers_per_rank, 0,
                        int(dataset.batch_size or 1)), -1, np.int64)
    return generate_work_per_stream_batching(cast("StreamingDataset", view), world, epoch,
                                             sample_in_epoch)


batching_methods[BATCHING] = per_stream_whole_batches


def _drop(units: NDArray[np.int64], sample_ids: NDArray[np.int64], keep: NDArray[np.bool_]
          ) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """Keep `sample_ids[keep]` and shrink the shuffle units (consecutive runs) to match."""
    if keep.all():
        return units, sample_ids
    starts = np.concatenate([[0], np.cumsum(units)[:-1]]).astype(np.int64)
    kept_per_unit = np.add.reduceat(keep.astype(np.int64), starts) if len(units) else units
    return kept_per_unit[kept_per_unit > 0].astype(np.int64), sample_ids[keep]


class _ShardMaps:
    """Memory maps of MDS joint shards: `[n][n + 1 uint32 offsets][config][samples]`."""

    def __init__(self, shards: list, limit: int):
        self.shards, self.limit = shards, limit
        self.open: OrderedDict[int, mmap.mmap] = OrderedDict()

    def sample(self, shard_id: int, index: int) -> bytes:
        data = self._map(shard_id)
        begin, end = np.frombuffer(data, np.uint32, 2, offset=4 * (1 + index))
        return data[begin:end]

    def _map(self, shard_id: int) -> mmap.mmap:
        data = self.open.get(shard_id)
        if data is not None:
            self.open.move_to_end(shard_id)
            return data
        shard = self.shards[shard_id]
        path = os.path.join(shard.dirname, shard.split, shard.raw_data.basename)
        with open(path, "rb") as file:
            data = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        self.open[shard_id] = data
        if len(self.open) > self.limit:
            self.open.popitem(last=False)[1].close()
        return data

    def close(self) -> None:
        while self.open:
            self.open.popitem()[1].close()


def _jpeg_as_bytes(shard, data: bytes) -> dict[str, Any]:
    """`MDSReader.decode_sample`, but `jpeg` columns stay the bytes they were stored as."""
    from streaming.base.format.mds.encodings import mds_decode

    sizes, head = [], 0
    for size in shard.column_sizes:
        if size is None:
            size = int(np.frombuffer(data, np.uint32, 1, offset=head)[0])
            head += 4
        sizes.append(size)
    sample, position = {}, head
    for name, encoding, size in zip(shard.column_names, shard.column_encodings, sizes,
                                    strict=True):
        value = data[position:position + size]
        sample[name] = value if encoding == "jpeg" else mds_decode(encoding, value)
        position += size
    return sample
