"""Leases and the pointer check: what they add to an incremental `mds_shards` run.

An incremental run (a few new samples appended to a source's tree, the way a sensor-started
run looks) is timed whole; then, in the same process and on the same storage, the steps the
leases and the compare-and-swap add to it are timed alone, many times over: the (asset,
source) writer lease and the source's tree lease taken and released, the pre-commit check
(lease held, pointer unchanged) and the pointer compare under its lock. Figure: their cost
against the run, on local disk and on the S3 test server (target: under 1 %).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import uuid
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa

from bench.common import Figure, report, s3_workspace, timed
from bench.mds import replicate
from prx_assets.demo.corpus import procedural_image
from prx_assets.engine import ray_runtime
from prx_assets.stages.captions.captions import CAPTIONS_SCHEMA
from prx_assets.stages.images.imaging import encode_jpeg
from prx_assets.stages.images.stage import BUCKETED_SCHEMA
from prx_assets.stages.shards.mds import write_mds_tree
from prx_assets.stages.shards.plan import WriteOptions
from prx_assets.storage.lance_tables import append_rows, overwrite_rows
from prx_assets.storage.layout import Storage
from prx_assets.storage.leases import tree_lease, writer_lease
from prx_assets.storage.trees import tree_store
from prx_assets.testing.mds_corpus import ACTIVE, _bucketed, _caption, build_corpus, inputs_for

SOURCE = "web"
RUNS = 3  # incremental runs timed (median)
REPEATS = 50  # lease + pointer-check rounds timed (mean)
# As production runs it: parts in Ray tasks. The corpus is small (800 thumbnails), so the
# run is close to its fixed cost (planning, one part, mapping commit, publish): the ratio
# is an upper bound for real sources.
OPTIONS = WriteOptions(size_limit=1 << 20, rows_per_part=200)
BUCKET = "prx-bench-leases"
LARGE_TIMES = 40


def add_samples(root: str, run: int, count: int = 4) -> None:
    """`count` new kept, captioned rows (one append commit per table)."""
    rng = np.random.default_rng(run)
    ids = [f"{SOURCE}:new-{run}-{i}" for i in range(count)]
    storage = Storage(root)
    rows = [_bucketed(i, SOURCE, "ok", 1, 64, 64, encode_jpeg(procedural_image(rng, 64, 64)))
            for i in ids]
    append_rows(storage.table("bucketed_images", SOURCE),
                pa.Table.from_pylist(rows, schema=BUCKETED_SCHEMA), BUCKETED_SCHEMA)
    captions = [_caption(i, ACTIVE, f"a picture {i}", "ok", datetime(2026, 1, 2, tzinfo=UTC))
                for i in ids]
    append_rows(storage.table("captions", SOURCE),
                pa.Table.from_pylist(captions, schema=CAPTIONS_SCHEMA), CAPTIONS_SCHEMA)


def incremental_run_s(root: str, first_run: int, options: WriteOptions) -> float:
    write_mds_tree(inputs_for(root, SOURCE), root, SOURCE, options)  # the first, full build
    times = []
    for run in range(first_run, first_run + RUNS):
        add_samples(root, run)
        seconds, report_ = timed(lambda: write_mds_tree(inputs_for(root, SOURCE), root,
                                                        SOURCE, options))
        assert report_.appended  # type: ignore[attr-defined]
        times.append(seconds)
    return statistics.median(times)


def lease_and_check_s(root: str) -> float:
    """One round of what the leases and the compare-and-swap add to a run."""
    storage = Storage(root)
    store = tree_store(storage, SOURCE)
    expected = store.current_version()

    def one_round() -> None:
        with writer_lease(storage.location(), "mds_shards", SOURCE), \
                tree_lease(store.data_root, SOURCE) as lease:
            lease.check()  # the pre-commit check: lease held, pointer unchanged
            assert store.current_version() == expected
            if store.is_local:
                with store.pointer_lock():  # the publish's compare, under its lock
                    assert store.current_version() == expected
            else:  # the publish's compare: the pointer read with its ETag
                from prx_assets.storage.leases import lease_file

                assert lease_file(store.link).read() is not None

    seconds, _ = timed(lambda: [one_round() for _ in range(REPEATS)])
    return seconds / REPEATS


def measure(label: str, root: str, first_run: int, options: WriteOptions = OPTIONS) -> Figure:
    run_s = incremental_run_s(root, first_run, options)
    added_s = lease_and_check_s(root)
    print(f"leases: {label}: incremental run {run_s * 1000:.0f} ms, leases + pointer check "
          f"{added_s * 1000:.2f} ms ({added_s / run_s:.2%})")
    return Figure("leases", f"lease+CAS ms/run, {label}", added_s * 1000,
                  "incremental mds_shards run", run_s * 1000, "ms")


def main() -> list[Figure]:
    with s3_workspace("bench-leases-") as (work, server):
        local = str(work / "local")
        build_corpus(Path(local), SOURCE, per_shape=200)
        # The S3 copy of the tables is taken before the local runs add samples.
        s3_root = f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}"
        tables = {name: Storage(local).table(name, SOURCE).to_table()
                  for name in ("bucketed_images", "captions")}
        ray_runtime.connect()
        figures = [measure("local", local, first_run=0)]
        # A larger source: the same thumbnails under new ids, 40 times over (32,000 rows).
        large = str(work / "large")
        build_corpus(Path(large), SOURCE, per_shape=200)
        replicate(Path(large), SOURCE, LARGE_TIMES)
        figures.append(measure(f"local, {800 * LARGE_TIMES:,} samples", large, first_run=0,
                               options=dataclasses.replace(OPTIONS, rows_per_part=8000)))
        os.environ.update(server.env())
        server.create_bucket(BUCKET)
        for name, table in tables.items():
            overwrite_rows(Storage(s3_root).table(name, SOURCE), table, table.schema)
        figures.append(measure("s3", s3_root, first_run=RUNS))
    report(figures, "leases")
    return figures


if __name__ == "__main__":
    main()
