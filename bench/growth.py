"""Cost that grows with the work, not with the table: metadata rows written through the
stages' own chunked writer (`engine.chunked.run_chunked`: Ray stage, chunks committed to
Lance, key index kept current, compaction and cleanup), at several partition sizes.

Rows are caption-like (a 24-hex-digit id as `ingest.ids.sample_id` makes, a caption
version, 25–40 words of text, a word count, a status), keyed on `id`. Per size N, each
on a fresh table:

- **append**: a first run, every row known new (`NewRows`): appended, no key lookup;
- **+0.1 %**: upstream (a Lance table of the N ids, the target holding the full run's
  record of it, `storage.changes`) appends N/1000 ids (before the clock: upstream's
  work); the run is handed what changed since the record, looks the new ids up in the
  target (`pending_changed_rows`), appends them and records; its seconds as a share of
  the full run's;
- **−0.1 %**: upstream then deletes N/1000 ids (before the clock); the run reads them
  from upstream's deletion vectors, deletes them (`delete_ids`) and records;
- the same two without a record, as a stage not told what changed: **+0.1 %, every id
  offered** (N + N/1000 ids, selected by `pending_new_rows`, an anti-join on the
  committed ids) and **−0.1 %, ids compared** (`engine.removals.removed_ids` over both
  id columns, as the image stage does after a compaction of raw_images);
- **merge**: the same N rows as rows that may exist: merge-inserted, looked up through
  the key index the run keeps current;
- **merge, no index** (the baseline, up to `--baseline-max`): the merge as it was before
  the key index, each chunk scanning the whole `id` column;
- **merge on 2 keys**: the same N rows merged on the captions table's key (`id`,
  `caption_version`, as labels and attributes add their versions), which Lance's
  merge-insert cannot look up through an index: the writer looks the chunk's rows up
  through the index on `id` and appends those absent (`upsert_looked_up`); its baseline
  (up to `--baseline-max`) each chunk merge-inserted on both keys, as before;
- the driver's peak PSS and the process tree's (driver plus Ray) during the append run;
- disk bytes per live byte of the table after the runs (every file under the table's
  folder, against the data and index files the latest version references).

Seconds per row and memory are printed as ratios against the smallest size; the merge
against its no-index baseline at the same size. Targets (issue 31): per-row ratio ≤ 1.2
from 10⁴ to 10⁶, memory ratio ≤ 1.2, ±0.1 % rerun ≤ 2 % of a full run, disk ≤ 1.2× live.

    python -m bench.growth --sizes 1e4,1e5,1e6
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa

from bench.common import Figure, report
from bench.proc_memory import DRIVER, BackgroundSampler, sample_tree

DEFAULT_SIZES = (2_000, 20_000)  # a smoke run for `make bench`; the note uses 1e4,1e5,1e6
CHUNK_ROWS = 1024  # the captions stage's chunk
SCHEMA = pa.schema([
    pa.field("id", pa.string(), nullable=False), pa.field("caption_version", pa.string()),
    pa.field("caption", pa.string()), pa.field("n_words", pa.int32()),
    pa.field("status", pa.string()),
])
CAPTION_WORDS = ("a red wooden boat on a grey river at sunset with two people and a dog near "
                 "the old stone bridge under heavy clouds while birds fly over green hills "
                 "in soft morning light")
WORDS = np.array(CAPTION_WORDS.split())


def sample_ids(start: int, stop: int) -> list[str]:
    """Ids like `ingest.ids.sample_id`: hashes, so they arrive in no order."""
    return [f"bench:{hashlib.blake2b(str(i).encode(), digest_size=12).hexdigest()}"
            for i in range(start, stop)]


def id_batch(batch: dict, start: int = 0) -> pa.Table:
    ids = batch["id"]
    return pa.table({"id": sample_ids(start + int(ids[0]), start + int(ids[-1]) + 1)})


def caption_rows(batch: pa.Table) -> pa.Table:
    """The stage: one caption-like row per id (deterministic per batch)."""
    rng = np.random.default_rng(batch.num_rows)
    counts = rng.integers(25, 41, batch.num_rows)
    captions = [" ".join(WORDS[rng.integers(0, len(WORDS), n)]) for n in counts]
    return pa.table({"id": batch.column("id"), "caption_version": ["v1"] * batch.num_rows,
                     "caption": captions, "n_words": pa.array(counts, pa.int32()),
                     "status": ["ok"] * batch.num_rows}, schema=SCHEMA)


def inputs(rows: int, start: int = 0):
    """The ids [start, start + rows) as a Ray dataset."""
    import ray.data

    blocks = max(1, rows // 65_536)
    return ray.data.range(rows, override_num_blocks=blocks).map_batches(
        id_batch, fn_kwargs={"start": start}, batch_size=None, batch_format="numpy")


def stage(rows):
    return rows.map_batches(caption_rows, batch_format="pyarrow", zero_copy_batch=True)


class DriverPeak(BackgroundSampler):
    """Peak PSS of this process and of its whole tree (with Ray), sampled from /proc."""

    def __init__(self, interval: float = 0.25):
        super().__init__(interval)
        self.driver_kb = self.tree_kb = 0

    def _run(self) -> None:
        while not self._stop.is_set():
            sample = sample_tree(os.getpid())
            self.driver_kb = max(self.driver_kb, sample.by_kind.get(DRIVER, 0))
            self.tree_kb = max(self.tree_kb, sample.pss_kb)
            self._stop.wait(self.interval)


@dataclass
class SizeRun:
    rows: int
    append_s: float = 0.0
    rerun_s: float = 0.0  # the +0.1 % run, handed upstream's changes
    shrink_s: float = 0.0  # the −0.1 % run, handed upstream's changes
    full_rerun_s: float = 0.0  # the +0.1 % run offered every id
    full_shrink_s: float = 0.0  # the −0.1 % run comparing both id columns
    merge_s: float = 0.0
    unindexed_merge_s: float | None = None
    merge_keys_s: float = 0.0  # the merge on the captions table's key (id, caption version)
    scanned_merge_keys_s: float | None = None  # the same, merge-inserted on both (before)
    driver_kb: int = 0
    tree_kb: int = 0
    disk_per_live: float = 0.0  # after the runs, with the captions table's 7-day retention
    disk_per_live_freed: float = 0.0  # then with superseded versions freed (grace 0)
    details: dict = field(default_factory=dict)


def timed_run(table_dir: Path, rows, policy, new_rows=None, chunk_rows: int = CHUNK_ROWS):
    from prx_assets.engine.chunked import CommitTarget, run_chunked
    from prx_assets.storage.refs import TableRef

    target = CommitTarget(TableRef.of(table_dir), SCHEMA, ["id"], policy)
    started = time.perf_counter()
    run = run_chunked(rows, stage, target, chunk_rows, new_rows=new_rows)
    return time.perf_counter() - started, run


UPSTREAM = "upstream"  # the name of the target's record of what it consumed upstream


def write_upstream(path: Path, ids: list[str]):
    """Upstream's table of the ids the full run consumed (its work: before any clock), and
    the target's record of it, as the full run's last step writes it."""
    import lance

    return lance.write_dataset(pa.table({"id": ids}), str(path))


def grow_by_record(table_dir: Path, upstream: Path, new_ids: list[str], policy
                   ) -> tuple[float, dict]:
    """The +0.1 % run handed upstream's changes: upstream appended `new_ids` (before the
    clock); the run finds them from the record, looks them up, appends them, records."""
    import lance

    from prx_assets.engine.chunked import pending_changed_rows
    from prx_assets.storage.changes import (
        changes_since,
        consumed_at,
        read_consumed,
        record_consumed,
    )
    from prx_assets.storage.refs import TableRef

    lance.write_dataset(pa.table({"id": new_ids}), str(upstream), mode="append")
    target, source = TableRef.of(table_dir), TableRef.of(upstream).pinned()
    started = time.perf_counter()
    since = read_consumed(target, UPSTREAM)
    assert since is not None, "the full run recorded what it consumed"
    changes = changes_since(source.open(), since)
    pending, new = pending_changed_rows(source, changes, target)
    _, run = timed_run(table_dir, pending, policy, new)
    record_consumed(target, UPSTREAM, consumed_at(source.open()))
    return time.perf_counter() - started, {"committed": run.committed,
                                           "offered": changes.added_rows}


def shrink_by_record(table_dir: Path, upstream: Path, gone: list[str]) -> tuple[float, dict]:
    """The −0.1 % run handed upstream's changes: upstream deleted `gone` (before the
    clock); the run reads them from the deletion vectors, deletes them, records."""
    from prx_assets.engine.removals import delete_ids
    from prx_assets.storage.changes import (
        changes_since,
        consumed_at,
        read_consumed,
        record_consumed,
    )
    from prx_assets.storage.refs import TableRef

    delete_ids(TableRef.of(upstream), pa.array(gone, pa.string()))
    target, source = TableRef.of(table_dir), TableRef.of(upstream).pinned()
    started = time.perf_counter()
    since = read_consumed(target, UPSTREAM)
    assert since is not None, "the +0.1 % run recorded what it consumed"
    removed = changes_since(source.open(), since).removed
    assert removed is not None, "no compaction of upstream in between"
    deleted = delete_ids(target, removed)
    record_consumed(target, UPSTREAM, consumed_at(source.open()))
    return time.perf_counter() - started, {"deleted": deleted, "live": target.count_rows()}


def shrink(table_dir: Path, held: tuple[int, int], gone: int, work: Path
           ) -> tuple[float, dict]:
    """The −0.1 % run compared in full: upstream (its table written before the clock)
    holds the ids [start + gone, stop) of the [start, stop) held; the first `gone` ids
    are found by comparing both id columns and deleted."""
    import lance

    from prx_assets.engine.removals import delete_ids, removed_ids
    from prx_assets.storage.refs import TableRef

    upstream = work / f"upstream-shrunk-{held[1]}.lance"
    lance.write_dataset(pa.table({"id": sample_ids(held[0] + gone, held[1])}), str(upstream))
    target = TableRef.of(table_dir)
    started = time.perf_counter()
    deleted = delete_ids(target, removed_ids(target, TableRef.of(upstream).pinned()))
    return time.perf_counter() - started, {"deleted": deleted, "live": target.count_rows()}


def record_full_run(table_dir: Path, upstream) -> None:
    from prx_assets.storage.changes import consumed_at, record_consumed
    from prx_assets.storage.refs import TableRef

    record_consumed(TableRef.of(table_dir), UPSTREAM, consumed_at(upstream))


def disk_per_live(table_dir: Path) -> float:
    """Every file under the table's folder against its live bytes: the data files and the
    key index the latest version references (the index is part of the table, not a
    leftover: ~0.4× the data of these short caption rows, negligible beside images)."""
    from prx_assets.storage.reads import data_bytes
    from prx_assets.storage.refs import TableRef

    table = TableRef.of(table_dir).open()
    disk = sum(p.stat().st_size for p in table_dir.rglob("*") if p.is_file())
    live = data_bytes(table) + sum(index.total_size_bytes for index in table.describe_indices())
    return disk / max(1, live)


def merge_on_both_keys(table_dir: Path, rows: int, chunk_rows: int) -> float:
    """The captions' run before its writer looked keys up itself: the same stage, each
    chunk merge-inserted on (id, caption version), which Lance joins against every row,
    no key index, then compaction and cleanup."""
    from prx_assets.engine.batches import arrow_batches
    from prx_assets.stages.captions.runs import CAPTIONS_TABLE
    from prx_assets.storage.lance_tables import cleanup, compact, upsert
    from prx_assets.storage.refs import TableRef

    table = TableRef.of(table_dir)
    started = time.perf_counter()
    for chunk in arrow_batches(stage(inputs(rows)), batch_size=chunk_rows):
        upsert(table, chunk, SCHEMA, list(CAPTIONS_TABLE.keys))
    compact(table, CAPTIONS_TABLE.fragments)
    cleanup(table.open(), CAPTIONS_TABLE.fragments)
    return time.perf_counter() - started


def measure(rows: int, work: Path, baseline_max: int, chunk_rows: int) -> SizeRun:
    from prx_assets.engine.chunked import CommitTarget, NewRows, pending_new_rows, run_chunked
    from prx_assets.stages.captions.runs import CAPTIONS_TABLE
    from prx_assets.storage.key_index import KeyIndexPolicy
    from prx_assets.storage.lance_tables import FragmentPolicy
    from prx_assets.storage.refs import TableRef
    from prx_assets.storage.retention import drop_superseded

    policy = FragmentPolicy(target_bytes=1 << 30, max_rows=1 << 20)  # the captions table's
    result = SizeRun(rows)
    appended = work / f"append-{rows}.lance"
    with DriverPeak() as peak:
        result.append_s, run = timed_run(appended, inputs(rows), policy, NewRows(None),
                                         chunk_rows)
    result.driver_kb, result.tree_kb = peak.driver_kb, peak.tree_kb
    result.details["append"] = {"commits": run.commits, "appended": run.appended,
                                "index_updates": run.index_updates}
    k = max(1, rows // 1000)
    record_full_run(appended, write_upstream(work / f"upstream-{rows}.lance", sample_ids(0, rows)))
    # Upstream's changes handed over: +k ids, then −k ids.
    result.rerun_s, result.details["rerun"] = grow_by_record(
        appended, work / f"upstream-{rows}.lance", sample_ids(rows, rows + k), policy)
    result.shrink_s, result.details["shrink"] = shrink_by_record(
        appended, work / f"upstream-{rows}.lance", sample_ids(0, k))
    # The same without them: every id offered (made before the clock: upstream's work),
    # then the ids gone found by comparing both id columns.
    more = inputs(rows + k, start=k).materialize()  # held: [k, N + k)
    started = time.perf_counter()
    pending, new = pending_new_rows(more, TableRef.of(appended))
    _, rerun = timed_run(appended, pending, policy, new, chunk_rows)
    result.full_rerun_s = time.perf_counter() - started
    result.details["full_rerun"] = {"committed": rerun.committed}
    result.full_shrink_s, result.details["full_shrink"] = shrink(appended, (k, rows + 2 * k),
                                                                 k, work)
    result.disk_per_live = disk_per_live(appended)
    drop_superseded(TableRef.of(appended).open(), timedelta(0))
    result.disk_per_live_freed = disk_per_live(appended)
    result.merge_s, _ = timed_run(work / f"merge-{rows}.lance", inputs(rows), policy,
                                  chunk_rows=chunk_rows)
    keyed = CommitTarget(TableRef.of(work / f"keys-{rows}.lance"), SCHEMA,
                         list(CAPTIONS_TABLE.keys), policy)
    started = time.perf_counter()
    run_chunked(inputs(rows), stage, keyed, chunk_rows)
    result.merge_keys_s = time.perf_counter() - started
    if rows <= baseline_max:
        result.scanned_merge_keys_s = merge_on_both_keys(work / f"scan-{rows}.lance", rows,
                                                         chunk_rows)
        unindexed = FragmentPolicy(target_bytes=1 << 30, max_rows=1 << 20,
                                   key_index=KeyIndexPolicy(enabled=False))
        result.unindexed_merge_s, _ = timed_run(work / f"noindex-{rows}.lance", inputs(rows),
                                                unindexed, chunk_rows=chunk_rows)
    return result


def figures(runs: list[SizeRun]) -> list[Figure]:
    first = runs[0]
    base = f"{first.rows:.0e} rows"
    out: list[Figure] = []
    for run in runs:
        at = f"@{run.rows:.0e}"
        out += [
            Figure("growth", f"append us/row {at}", 1e6 * run.append_s / run.rows, base,
                   1e6 * first.append_s / first.rows, "us/row"),
            Figure("growth", f"merge us/row {at}", 1e6 * run.merge_s / run.rows, base,
                   1e6 * first.merge_s / first.rows, "us/row"),
            Figure("growth", f"merge on 2 keys us/row {at}", 1e6 * run.merge_keys_s / run.rows,
                   base, 1e6 * first.merge_keys_s / first.rows, "us/row"),
            Figure("growth", f"driver peak PSS {at}", run.driver_kb / 1024, base,
                   first.driver_kb / 1024, "MiB"),
            Figure("growth", f"tree peak PSS {at}", run.tree_kb / 1024, base,
                   first.tree_kb / 1024, "MiB"),
            Figure("growth", f"+0.1% rerun s {at}", run.rerun_s, "full append run",
                   run.append_s, "s"),
            Figure("growth", f"-0.1% rerun s {at}", run.shrink_s, "full append run",
                   run.append_s, "s"),
            Figure("growth", f"+0.1% rerun, every id offered s {at}", run.full_rerun_s,
                   "full append run", run.append_s, "s"),
            Figure("growth", f"-0.1% rerun, ids compared s {at}", run.full_shrink_s,
                   "full append run", run.append_s, "s"),
            Figure("growth", f"disk/live 7-day {at}", run.disk_per_live, "live bytes", 1.0,
                   "x"),
            Figure("growth", f"disk/live freed {at}", run.disk_per_live_freed, "live bytes",
                   1.0, "x"),
        ]
        if run.unindexed_merge_s is not None:
            out.append(Figure("growth", f"merge, key index {at}", run.merge_s,
                              "merge without index", run.unindexed_merge_s, "s"))
        if run.scanned_merge_keys_s is not None:
            out.append(Figure("growth", f"merge on 2 keys, looked up {at}", run.merge_keys_s,
                              "merge-insert on both keys", run.scanned_merge_keys_s, "s"))
    return out


def parse_sizes(text: str) -> list[int]:
    return sorted({int(float(part)) for part in text.split(",") if part.strip()})


def run(sizes: list[int], baseline_max: int, chunk_rows: int = CHUNK_ROWS) -> list[SizeRun]:
    """Every size measured on fresh tables in a temporary folder (removed after)."""
    from prx_assets.engine import ray_runtime
    from prx_assets.storage.lance_tables import FragmentPolicy

    ray_runtime.connect(num_cpus=2)
    work = Path(tempfile.mkdtemp(prefix="prx-growth-"))
    try:
        # Ray Data's first execution starts its workers and actors: not the table's cost.
        timed_run(work / "warm-up.lance", inputs(2 * chunk_rows), FragmentPolicy())
        return [measure(rows, work, baseline_max, chunk_rows) for rows in sizes]
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)))
    parser.add_argument("--baseline-max", type=float, default=1e5,
                        help="largest size at which the no-index merge baseline runs")
    parser.add_argument("--chunk-rows", type=int, default=CHUNK_ROWS)
    args = parser.parse_args(argv if argv is not None else [])
    runs = run(parse_sizes(args.sizes), int(args.baseline_max), args.chunk_rows)
    report(figures(runs), "growth")


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
