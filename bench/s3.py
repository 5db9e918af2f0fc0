"""Object storage: the same work with PRX_DATA_ROOT=s3:// against local disk, on a SeaweedFS
server this bench starts on 127.0.0.1 (the test suite's fixture, bench/out/s3-server).

1. Ingest: rows/s of `build_raw_dataset` + `write_dataset_atomically` into a bucket, as a
   ratio of the same into a local folder.
2. MDS write: `write_mds_tree` MB/s with the root in the bucket (a versioned prefix, the
   pointer object last), as a ratio of a local root.
3. Loader: samples/s of the project loader (`prx_assets.loader.build_dataset`, skip lists
   applied) over a tree in the bucket, with an empty cache (every shard downloaded) and then
   a warm one, as a ratio of the same loader over the same tree on local disk; plus plain
   `StreamingDataset(remote=<leaf>, local=cache)` cold, for scale.

Loopback to a server on the same two cores: the ratios say what the object-store path costs
in CPU and protocol, not what a network adds.
"""

from __future__ import annotations

import functools
import os
import uuid
from pathlib import Path

import numpy as np

from bench.common import (
    OUT,
    Figure,
    generated_jpegs,
    release_loader,
    report,
    s3_workspace,
    timed,
)
from prx_assets.engine import ray_runtime
from prx_assets.stages.ingest.ingest import IngestOptions, build_raw_dataset
from prx_assets.stages.ingest.raw_rows import RAW_IMAGES_SCHEMA
from prx_assets.stages.ingest.sources import SourceSpec
from prx_assets.storage.lance_tables import FragmentPolicy, write_dataset_atomically
from prx_assets.storage.layout import Storage
from prx_assets.storage.refs import Location
from prx_assets.storage.tables import RAW_IMAGES

N_IMAGES = 160
BUCKET = "prx-bench"
BATCH = 32
LOAD_SHAPES = ((1, 64, 64),)
MDS_PER_SHAPE = 200  # samples per shape of the fixture corpus for the MDS write figure


def ingest_once(folder: Path, root: str) -> int:
    spec = SourceSpec(name="bench", kind="image_folder", uri=str(folder))
    dataset = build_raw_dataset(spec, folder, IngestOptions(units_per_task=32))
    return write_dataset_atomically(dataset, Storage(root).table(RAW_IMAGES, "bench"),
                                    FragmentPolicy(), RAW_IMAGES_SCHEMA).rows


def bench_ingest(local_root: Path, s3_root: str) -> list[Figure]:
    folder = generated_jpegs(OUT / "corpus_ingest", N_IMAGES)
    megabytes = sum(p.stat().st_size for p in sorted(folder.glob("*.jpg"))[:N_IMAGES]) / 1e6
    ingest_once(folder, str(local_root / "warm"))  # warm Ray workers, imports
    local_s, rows = timed(lambda: ingest_once(folder, str(local_root / "ingest")))
    s3_s, s3_rows = timed(lambda: ingest_once(folder, s3_root))
    assert rows == s3_rows, (rows, s3_rows)
    print(f"s3 ingest: {rows} rows, {megabytes:.1f} MB: local {local_s:.2f} s, s3:// {s3_s:.2f} s")
    return [Figure("s3", "ingest rows/s, s3:// root", rows / s3_s, "local disk", rows / local_s,
                   "rows/s")]


def bench_mds_write(local_root: Path, s3_root: str) -> list[Figure]:
    from prx_assets.stages.shards.mds import write_mds_tree
    from prx_assets.stages.shards.plan import WriteOptions
    from prx_assets.testing.mds_corpus import build_corpus, inputs_for

    build_corpus(local_root / "mds-in", "bench", per_shape=MDS_PER_SHAPE, uncaptioned=0,
                 rejected=0)
    inputs = inputs_for(local_root / "mds-in", "bench")
    options = WriteOptions(rows_per_part=200)
    quiet = {"log": lambda _: None}
    # Warm the Ray workers and imports first (as the ingest figure does), else the first
    # write pays for them.
    write_mds_tree(inputs, local_root / "mds-warm", "bench", options, **quiet)
    local_s, tree = timed(lambda: write_mds_tree(inputs, local_root / "mds-out", "bench",
                                                 options, **quiet))
    s3_s, s3_tree = timed(lambda: write_mds_tree(inputs, Storage(s3_root), "bench",
                                                 options, **quiet))
    print(f"s3 mds write: {tree.bytes / 1e6:.1f} MB: local {local_s:.2f} s, "
          f"s3:// {s3_s:.2f} s")
    return [Figure("s3", "MDS write MB/s, s3:// root", s3_tree.bytes / 1e6 / s3_s, "local disk",
                   tree.bytes / 1e6 / local_s, "MB/s")]


def iterate(dataset) -> int:
    return sum(1 for _ in dataset)


def streamed(**stream) -> tuple[float, int]:
    from streaming import Stream, StreamingDataset

    from prx_assets.testing.shared_memory import release_shared_memory

    release_shared_memory(stream["local"])
    dataset = StreamingDataset(streams=[Stream(**stream)], batch_size=BATCH, shuffle=False)
    seconds, samples = timed(functools.partial(iterate, dataset))
    del dataset
    return seconds, samples


def loaded(root: Location | str, cache: Path | None) -> tuple[float, int]:
    """Seconds and samples for one pass of the project loader (`prx_assets.loader`: skip
    lists applied, sidecars read beside the shards) over tier 1 of the tree under `root`."""
    from prx_assets.loader import build_dataset
    from prx_assets.testing.shared_memory import release_shared_memory

    release_shared_memory(cache or str(root))
    dataset = build_dataset(root, 1, BATCH, weights={"bench": 1.0}, shuffle=False,
                            cache_dir=cache)
    seconds, samples = timed(functools.partial(iterate, dataset))
    release_loader(dataset)
    del dataset
    return seconds, samples


def bench_loader(local_root: Path, s3_root: str, work: Path) -> list[Figure]:
    """The same tree written twice from the same tables, under a local root and into the
    bucket (versioned prefix + pointer); the project loader reads each, the remote one
    into an empty cache (every shard downloaded) and then again warm."""
    from prx_assets.stages.shards.mds import write_mds_tree
    from prx_assets.stages.shards.plan import WriteOptions
    from prx_assets.storage.trees import current_tree, current_tree_uri, tree_leaves
    from prx_assets.testing.mds_corpus import build_corpus, inputs_for

    root = local_root / "load"
    build_corpus(root, "bench", per_shape=3000, shapes=LOAD_SHAPES, uncaptioned=0, rejected=0)
    options, quiet = WriteOptions(size_limit=1 << 20, parallel=False), {"log": lambda _: None}
    write_mds_tree(inputs_for(root, "bench"), root, "bench", options, **quiet)
    remote_root = Storage(f"{s3_root}-load")
    write_mds_tree(inputs_for(root, "bench"), remote_root, "bench", options, **quiet)

    local_s, local_n = loaded(str(root / "mds"), None)
    cache = work / "loader-cache"
    cold_s, cold_n = loaded(remote_root.mds_root, cache)
    warm_s, warm_n = loaded(remote_root.mds_root, cache)
    assert local_n == cold_n == warm_n, (local_n, cold_n, warm_n)
    # mosaicml-streaming alone on one leaf of the remote tree (what a trainer without our
    # loader gets), for scale: the loader adds the sidecar reads and the skip filter.
    [leaf] = tree_leaves(current_tree(root / "mds", "bench"), 1)
    remote_leaf = f"{current_tree_uri(remote_root, 'bench')}/{leaf.parent.name}/{leaf.name}"
    plain_s, plain_n = streamed(remote=remote_leaf, local=str(work / "plain-cache"))
    # The loader yields whole global batches only (no padding, no repeats): a stream's last
    # partial batch is left out, which plain StreamingDataset pads instead.
    assert local_n <= plain_n < local_n + BATCH, (plain_n, local_n)
    print(f"s3 loader: {local_n} samples; local {local_s:.2f} s, remote cold {cold_s:.2f} s, "
          f"warm {warm_s:.2f} s; plain StreamingDataset remote cold {plain_s:.2f} s")
    return [
        Figure("s3", "loader samples/s, remote cold", cold_n / cold_s, "local shards",
               local_n / local_s, "sample/s"),
        Figure("s3", "loader samples/s, remote warm", warm_n / warm_s, "local shards",
               local_n / local_s, "sample/s"),
        Figure("s3", "plain StreamingDataset samples/s, remote cold", plain_n / plain_s,
               "our loader, local shards", local_n / local_s, "sample/s"),
    ]


def main() -> list[Figure]:
    with s3_workspace("bench-s3-") as (work, server):
        # The standard variables a user's shell holds (the bench plays that user): the
        # pipeline resolves its settings from them once, on the driver, and hands them to
        # Ray tasks in its handles; the loader's downloads (boto3) read them as they are.
        os.environ.update(server.env())
        server.create_bucket(BUCKET)
        ray_runtime.connect()
        s3_root = f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}"
        local_root = work / "local"
        figures = bench_ingest(local_root, s3_root)
        figures += bench_mds_write(local_root, s3_root)
        figures += bench_loader(local_root, s3_root, work)
    report(figures, "s3")
    return figures


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
