"""Object storage: the same work with PRX_DATA_ROOT=s3:// against local disk, on a SeaweedFS
server this bench starts on 127.0.0.1 (the test suite's fixture, bench/out/s3-server).

1. Ingest: rows/s of `build_raw_dataset` + `write_dataset_atomically` into a bucket, as a
   ratio of the same into a local folder.
2. MDS write: `write_mds_tree` MB/s with the root in the bucket, as a ratio of a local root
   (reported as not available while the MDS writer needs a local folder).
3. Loader: samples/s of mosaicml-streaming's `StreamingDataset(remote=s3://..., local=cache)`
   over one leaf, with an empty cache (every shard downloaded) and then a warm one, as a
   ratio of `StreamingDataset(local=<the same leaf on disk>)`; and our `build_dataset`
   (skip lists applied) with `mds_root` in the bucket, where it accepts one.

Loopback to a server on the same two cores: the ratios say what the object-store path costs
in CPU and protocol, not what a network adds.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
import uuid
from pathlib import Path

import numpy as np

from bench.common import OUT, Figure, generated_jpegs, report, timed
from prx_assets.engine import ray_runtime
from prx_assets.s1_ingest.ingest import IngestOptions, build_raw_dataset
from prx_assets.s1_ingest.raw_rows import RAW_IMAGES_SCHEMA
from prx_assets.s1_ingest.sources import SourceSpec
from prx_assets.storage import object_store
from prx_assets.storage.lance_tables import FragmentPolicy, write_dataset_atomically
from prx_assets.storage.layout import Storage
from prx_assets.storage.tables import RAW_IMAGES

N_IMAGES = 160
BUCKET = "prx-bench"
BATCH = 32
LOAD_SHAPES = ((1, 64, 64),)


def ingest_once(folder: Path, root: str, work: Path) -> int:
    spec = SourceSpec(name="bench", kind="image_folder", uri=str(folder))
    dataset = build_raw_dataset(spec, folder, work, IngestOptions(units_per_task=32))
    return write_dataset_atomically(dataset, Storage(root).table(RAW_IMAGES, "bench"),
                                    FragmentPolicy(), RAW_IMAGES_SCHEMA).rows


def bench_ingest(local_root: Path, s3_root: str, work: Path) -> list[Figure]:
    folder = generated_jpegs(OUT / "corpus_ingest", N_IMAGES)
    megabytes = sum(p.stat().st_size for p in sorted(folder.glob("*.jpg"))[:N_IMAGES]) / 1e6
    ingest_once(folder, str(local_root / "warm"), work / "w0")  # warm Ray workers, imports
    local_s, rows = timed(lambda: ingest_once(folder, str(local_root / "ingest"), work / "w1"))
    s3_s, s3_rows = timed(lambda: ingest_once(folder, s3_root, work / "w2"))
    assert rows == s3_rows, (rows, s3_rows)
    print(f"s3 ingest: {rows} rows, {megabytes:.1f} MB: local {local_s:.2f} s, s3:// {s3_s:.2f} s")
    return [Figure("s3", "ingest rows/s, s3:// root", rows / s3_s, "local disk", rows / local_s,
                   "rows/s")]


def bench_mds_write(local_root: Path, s3_root: str) -> list[Figure]:
    from prx_assets.s7_shards import mds
    from prx_assets_tests.fixtures.mds_corpus import build_corpus, inputs_for

    build_corpus(local_root / "mds-in", "bench", per_shape=40, uncaptioned=0, rejected=0)
    inputs = inputs_for(local_root / "mds-in", "bench")
    options = mds.WriteOptions(rows_per_part=200)
    quiet = dict(log=lambda _: None)
    local_s, tree = timed(lambda: mds.write_mds_tree(inputs, local_root / "mds-out", "bench",
                                                     options, **quiet))
    try:
        s3_s, s3_tree = timed(lambda: mds.write_mds_tree(inputs, Storage(s3_root), "bench",
                                                         options, **quiet))
    except Exception as exc:  # the writer still needs a local folder on this branch
        print(f"s3 mds write: not available with the root in the bucket "
              f"({type(exc).__name__}: {str(exc)[:160]})")
        return []
    return [Figure("s3", "MDS write MB/s, s3:// root", s3_tree.bytes / 1e6 / s3_s, "local disk",
                   tree.bytes / 1e6 / local_s, "MB/s")]


def upload_folder(client, folder: Path, bucket: str, prefix: str) -> None:
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(folder)}")


def iterate(dataset) -> int:
    return sum(1 for _ in dataset)


def streamed(**stream) -> tuple[float, int]:
    from streaming import Stream, StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    dataset = StreamingDataset(streams=[Stream(**stream)], batch_size=BATCH, shuffle=False)
    seconds, samples = timed(functools.partial(iterate, dataset))
    del dataset
    return seconds, samples


def bench_loader(local_root: Path, s3_root: str, server, work: Path) -> list[Figure]:
    from prx_assets.s7_shards import mds
    from prx_assets_tests.fixtures.mds_corpus import build_corpus, inputs_for

    root = local_root / "load"
    build_corpus(root, "bench", per_shape=3000, shapes=LOAD_SHAPES, uncaptioned=0, rejected=0)
    mds.write_mds_tree(inputs_for(root, "bench"), root, "bench",
                       mds.WriteOptions(size_limit=1 << 20, parallel=False), log=lambda _: None)
    [leaf] = mds.tree_leaves(mds.current_tree(root / "mds", "bench"), 1)
    _, bucket, prefix = object_store.split_uri(s3_root)
    upload_folder(server.client(), leaf, bucket, f"{prefix}/leaf")
    remote = f"{s3_root}/leaf"

    local_s, local_n = streamed(local=str(leaf))
    cache = work / "stream-cache"
    cold_s, cold_n = streamed(remote=remote, local=str(cache))
    warm_s, warm_n = streamed(remote=remote, local=str(cache))
    assert local_n == cold_n == warm_n, (local_n, cold_n, warm_n)
    print(f"s3 loader: {local_n} samples; local {local_s:.2f} s, remote cold {cold_s:.2f} s, "
          f"warm {warm_s:.2f} s")
    figures = [
        Figure("s3", "loader samples/s, remote cold", cold_n / cold_s, "local shards",
               local_n / local_s, "sample/s"),
        Figure("s3", "loader samples/s, remote warm", warm_n / warm_s, "local shards",
               local_n / local_s, "sample/s"),
    ]
    try:
        from prx_assets.loader import build_dataset

        ours = build_dataset(f"{s3_root}/mds", 1, BATCH, weights={"bench": 1.0})
        iterate(ours)
    except Exception as exc:  # build_dataset plans leaves from a local folder on this branch
        print(f"s3 loader: build_dataset(mds_root=s3://...) not available "
              f"({type(exc).__name__}: {str(exc)[:160]})")
    return figures


def main() -> list[Figure]:
    from prx_assets_tests.fixtures.s3_server import start_seaweedfs

    OUT.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-s3-", dir=OUT))
    server = start_seaweedfs(work / "server")
    saved = dict(os.environ)
    try:
        # The variables a user sets (and mosaicml-streaming's own name for the endpoint);
        # set before Ray starts, so its workers see them as a cluster's nodes would.
        os.environ.update({**server.env(), "S3_ENDPOINT_URL": server.endpoint})
        server.create_bucket(BUCKET)
        ray_runtime.connect()
        s3_root = f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}"
        local_root = work / "local"
        figures = bench_ingest(local_root, s3_root, work)
        figures += bench_mds_write(local_root, s3_root)
        figures += bench_loader(local_root, s3_root, server, work)
    finally:
        ray_runtime.disconnect()
        os.environ.clear()
        os.environ.update(saved)
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    report(figures, "s3")
    return figures


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
