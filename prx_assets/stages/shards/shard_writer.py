"""MDS shards written without importing mosaicml-streaming: the bytes and index entries its
`MDSWriter` writes for uncompressed shards of bytes, strings and ints (a test compares them
byte for byte), into a part's `Location` (a local folder, or each shard one PUT).

Importing streaming imports torch, transformers and scikit-learn (~6 s of CPU): a Ray worker
writing a source's few parts paid that every run, where the write itself is a few hundred
milliseconds (2,000 images). Compressed shards still go through streaming (`part_writer`).

The layout (streaming's `MDSWriter.encode_sample` and `encode_joint_shard`): a sample is the
uint32 sizes of its variable-size columns, then every column's bytes, columns sorted by name;
a shard is its sample count (uint32), the samples' offsets (uint32, one past the last), the
writer's configuration as JSON, then the samples. A shard is flushed before the sample that
would take it past `size_limit`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from prx_assets.storage.refs import Location

MDS_VERSION = 2
SAMPLE_OVERHEAD = 4  # a sample's offset in its shard's header
SHARD_OVERHEAD = 4 + 4  # a shard's sample count and its last offset


def _as_bytes(value: Any) -> bytes:
    if not isinstance(value, bytes):
        raise TypeError(f"an image column takes the encoded bytes, not {type(value).__name__}")
    return value


def _utf8(value: Any) -> bytes:
    if not isinstance(value, str):
        raise TypeError(f"a str column takes a str, not {type(value).__name__}")
    return value.encode("utf-8")


def _int64(value: Any) -> bytes:
    if not isinstance(value, int):
        raise TypeError(f"an int column takes an int, not {type(value).__name__}")
    return np.int64(value).tobytes()


# encoding -> (how a value becomes bytes, its fixed size or None)
ENCODINGS: dict[str, tuple[Callable[[Any], bytes], int | None]] = {
    "bytes": (_as_bytes, None), "jpeg": (_as_bytes, None), "png": (_as_bytes, None),
    "str": (_utf8, None), "int": (_int64, 8),
}


class ShardWriter:
    """Samples in, `shard.NNNNN.mds` files out in `out`; `shards` holds each shard's index
    entry, as `MDSWriter.shards` does."""

    def __init__(self, out: Location, columns: dict[str, str], size_limit: int | None):
        unsupported = {name: enc for name, enc in columns.items() if enc not in ENCODINGS}
        if unsupported:
            raise ValueError(f"no torch-free encoder for {unsupported}: use streaming's MDSWriter")
        if size_limit is not None and not 0 <= size_limit < 2**32:
            raise ValueError(f"size_limit must be in [0, 2**32), not {size_limit}")
        self.out = out
        self.size_limit = size_limit or None
        self.names = sorted(columns)
        self.encoders = [ENCODINGS[columns[name]] for name in self.names]
        self.config = {"version": MDS_VERSION, "format": "mds", "compression": None,
                       "hashes": [], "size_limit": self.size_limit,
                       "column_names": self.names,
                       "column_encodings": [columns[name] for name in self.names],
                       "column_sizes": [size for _, size in self.encoders]}
        self.config_data = json.dumps(self.config, sort_keys=True).encode("utf-8")
        self.shards: list[dict] = []
        self._samples: list[bytes] = []
        self._size = self._empty_size()

    def _empty_size(self) -> int:
        return SHARD_OVERHEAD + len(self.config_data)

    def encode(self, sample: dict[str, Any]) -> bytes:
        sizes, data = [], []
        for name, (encode, size) in zip(self.names, self.encoders, strict=True):
            datum = encode(sample[name])
            if size is None:
                sizes.append(len(datum))
            elif len(datum) != size:
                raise ValueError(f"column {name}: {len(datum)} bytes, not {size}")
            data.append(datum)
        return np.array(sizes, np.uint32).tobytes() + b"".join(data)

    def write(self, sample: dict[str, Any]) -> None:
        encoded = self.encode(sample)
        size = len(encoded) + SAMPLE_OVERHEAD
        if self.size_limit and self.size_limit < self._size + size:
            self.flush()
        self._samples.append(encoded)
        self._size += size

    def flush(self) -> None:
        """Write the samples held as the next shard (an empty one too, as MDSWriter does
        when a single sample is over the limit)."""
        count = np.uint32(len(self._samples))
        offsets = np.array([0, *map(len, self._samples)]).cumsum().astype(np.uint32)
        offsets += len(count.tobytes()) + len(offsets.tobytes()) + len(self.config_data)
        data = count.tobytes() + offsets.tobytes() + self.config_data + b"".join(self._samples)
        basename = f"shard.{len(self.shards):05d}.mds"
        _write(self.out / basename, data)
        self.shards.append({"samples": len(self._samples),
                            "raw_data": {"basename": basename, "bytes": len(data),
                                         "hashes": {}},
                            "zip_data": None, **self.config})
        self._samples, self._size = [], self._empty_size()

    def finish(self) -> None:
        if self._samples:
            self.flush()


def _write(file: Location, data: bytes) -> None:
    """A shard of a part folder (staged, published only through the tree's swap): written
    plainly locally (a kill leaves the part to the next run's cleanup), one PUT on S3."""
    if file.is_local:
        file.path.write_bytes(data)
    else:
        file.write_bytes(data)


@contextmanager
def shard_writer(out: Location, columns: dict[str, str], size_limit: int | None
                 ) -> Iterator[ShardWriter]:
    """A writer into the part folder `out` (emptied first, as `MDSWriter(exist_ok=True)`
    does); its last shard is written when the block ends without an error."""
    if out.is_local:
        out.delete()
        out.path.mkdir(parents=True)
    writer = ShardWriter(out, columns, size_limit)
    yield writer
    writer.finish()
