"""MDS stage: writing shards against copying the same bytes, and the loader against a plain
StreamingDataset over the same shards.

1. Writing: `write_mds_tree` (Ray parts, verbatim JPEG bytes, index merge, mapping table,
   atomic swap) on ~512x512 Q92 JPEGs held in Lance, in MB/s, against reading the same
   `image` column from Lance and writing the bytes into one file (target >= 0.5x).
2. Loading: `SkipListStreamingDataset` (skip lists applied, ~10 % skipped) against
   mosaicml-streaming's `StreamingDataset` with default settings (no skip lists), both
   iterated for one epoch of samples in one process (target >= 5x). Two figures: yielding
   PIL images like the base class, and yielding the JPEG bytes (what `build_loader` does:
   its collate function decodes each image once, in the DataLoader workers).
"""

from __future__ import annotations

import functools
import json
import shutil
import tempfile
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from bench.common import OUT, Figure, release_loader, report, timed
from prx_assets.engine import ray_runtime
from prx_assets.stages.shards.mds import write_mds_tree
from prx_assets.stages.shards.plan import WriteOptions
from prx_assets.storage.lance_tables import FragmentPolicy, overwrite_rows
from prx_assets.storage.layout import Storage
from prx_assets.storage.refs import TableRef
from prx_assets.storage.sidecars import sidecar_path
from prx_assets.storage.tables import BUCKETED_IMAGES, CAPTIONS
from prx_assets.storage.trees import current_tree, tree_leaves
from prx_assets.testing.mds_corpus import build_corpus, inputs_for

WRITE_SHAPES = ((512, 512, 512), (512, 448, 576), (512, 576, 448))
LOAD_SHAPES = ((1, 64, 64), (1, 48, 80), (1, 80, 48))
BATCH = 32


def copy_baseline(bucketed: TableRef, out: Path) -> int:
    """Read the image column from Lance and write every JPEG into one file."""
    written = 0
    with open(out, "wb") as sink:
        for batch in bucketed.open().to_batches(columns=["image"], filter="status = 'ok'"):
            for image in batch.column("image").to_pylist():
                written += sink.write(image)
    return written


def replicate(root: Path, source: str, times: int) -> None:
    """Grow the bucketed and captions tables `times`-fold with new ids and the same bytes
    (generating ~512x512 images is the slow part of building a bench corpus)."""
    for asset in (BUCKETED_IMAGES, CAPTIONS):
        ref = Storage(root).table(asset, source)
        table = ref.to_table()
        copies = [table.set_column(table.schema.get_field_index("id"), "id",
                                   pc.binary_join_element_wise(table["id"], f"-{k}", ""))
                  for k in range(times)]
        overwrite_rows(ref, pa.concat_tables(copies), table.schema, FragmentPolicy(max_rows=1000))


def bench_writing(work: Path) -> list[Figure]:
    root = work / "write"
    build_corpus(root, "bench", per_shape=40, shapes=WRITE_SHAPES, uncaptioned=0, rejected=0)
    replicate(root, "bench", 20)  # 2,400 images, ~100 MB
    inputs = inputs_for(root, "bench")
    # Several Ray tasks, as on a real source; full builds (an incremental rerun of the same
    # inputs would find nothing to write).
    options = WriteOptions(rows_per_part=400, incremental=False)
    write_mds_tree(inputs, root, "bench", options, log=lambda _: None)  # warm the workers
    write_s, tree = timed(lambda: write_mds_tree(inputs, root, "bench", options,
                                                 log=lambda _: None))
    copy_s, copied = timed(lambda: copy_baseline(
        Storage(root).table(BUCKETED_IMAGES, "bench"), work / "copy.bin"))
    print(f"mds write: {tree.samples} samples, {tree.shards} shards, {tree.bytes / 1e6:.1f} MB "
          f"in {write_s:.2f} s; copy {copied / 1e6:.1f} MB in {copy_s:.2f} s")
    return [Figure("mds", "write MB/s", tree.bytes / 1e6 / write_s, "read Lance + copy bytes",
                   copied / 1e6 / copy_s, "MB/s")]


def add_skip_lists(mds_root: Path, source: str, every: int = 10) -> int:
    """Skip about one sample in `every` (by a hash of its place), as dedup would."""
    skipped = 0
    for leaf in tree_leaves(current_tree(mds_root, source)):
        for shard in json.loads((leaf / "index.json").read_text())["shards"]:
            name = shard["raw_data"]["basename"]
            indices = [i for i in range(shard["samples"])
                       if zlib.crc32(f"{leaf.name}/{name}/{i}".encode()) % every == 0]
            sidecar_path(leaf / name).write_text(
                json.dumps({"version": 1, "lists": {"dedup": indices}}))
            skipped += len(indices)
    return skipped


def iterate(dataset) -> int:
    return sum(1 for _ in dataset)


def bench_loading(work: Path) -> list[Figure]:
    from streaming import Stream, StreamingDataset

    from prx_assets.loader import build_dataset
    from prx_assets.testing.shared_memory import release_shared_memory

    root = work / "load"
    build_corpus(root, "bench", per_shape=2000, shapes=LOAD_SHAPES, uncaptioned=0, rejected=0)
    write_mds_tree(inputs_for(root, "bench"), root, "bench",
                   WriteOptions(size_limit=1 << 20, parallel=False), log=lambda _: None)
    skipped = add_skip_lists(root / "mds", "bench")
    leaves = tree_leaves(current_tree(root, "bench"), 1)

    release_shared_memory(root)
    plain = StreamingDataset(streams=[Stream(local=str(leaf)) for leaf in leaves],
                             batch_size=BATCH)
    plain_s, plain_n = timed(functools.partial(iterate, plain))
    del plain
    figures = []
    for decode, label in ((True, "PIL images"), (False, "JPEG bytes")):
        release_shared_memory(root)
        ours = build_dataset(root / "mds", 1, BATCH, weights={"bench": 1.0}, seed=1,
                             decode_images=decode)
        ours_s, ours_n = timed(functools.partial(iterate, ours))
        release_loader(ours)
        del ours
        print(f"loader: plain StreamingDataset {plain_n} samples in {plain_s:.2f} s; ours "
              f"({label}) {ours_n} samples ({skipped} skipped, trimmed to whole batches) "
              f"in {ours_s:.2f} s")
        figures.append(Figure("mds", f"loader samples/s, {label}", ours_n / ours_s,
                              "plain StreamingDataset", plain_n / plain_s, "sample/s"))
    return figures


def main() -> None:
    ray_runtime.connect()
    OUT.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-mds-", dir=OUT))
    try:
        figures = bench_writing(work) + bench_loading(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(figures, "mds")


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
