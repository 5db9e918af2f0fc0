"""Ingest: the cost of reading training reservations (issue 46), as raw rows/s of the
ingest's per-row work (`raw_row`: header probe, sha256, provenance, and the signal readers)
with the readers against the same work without them (`read_rights=False`).

Two sets of real photos (scikit-image's samples at their own sizes, 0.1-2 MP, as JPEG, PNG
and WebP): `plain`, without XMP or a C2PA manifest (what most of a crawl is: the readers
cost a walk of the segment headers only), and `mixed`: half of them carrying XMP written by
exiftool (plus:DataMining in element and attribute form, and each file its own
xmpMM:DocumentID, InstanceID and OriginalDocumentID, so that no two packets are alike, as
in a crawl: nothing read once is reused) and one in sixteen a C2PA "do not train" manifest
signed by c2pa-python (read from its JUMBF boxes), every one with a crawler's `.json`
sidecar. The bytes are in memory: reading the file is the same with or without the readers,
so leaving it out makes the readers' share larger, not smaller.

Measured in pairs: one pass over the set with the readers and one without, back to back
(which goes first swaps each pair), in this thread's CPU seconds, so that the load of a
shared machine falls on both halves of a pair alike. A pair's cost is its with/without
ratio less one; the figure is the median over the pairs, with the quartiles and a 95 %
confidence interval of the median (order statistics: no assumption about the spread).
Target: ≤ 5 % slower.

That denominator is only part of an ingest's work for a row, so the same sets are measured
at the ingest's level too: each set, made one commit's worth of rows (21 times over: 1,008
rows, the ingest's `chunk_rows` being 1,024; the mixed set's copies each with its own XMP
packets and C2PA manifests, so that no read is served from the findings kept per packet),
written as one WebDataset shard (`<key>.<ext>` and `<key>.json`, as a crawler writes them;
every sample of both sets has its `.json`). A pass is what an ingest task and its driver do
for that shard: read it from disk
(`readers.read_tar`, through the ingest's `_unit_rows`), build the rows, convert them to
Arrow (`rows_to_tables`, RAW_IMAGES_SCHEMA) and commit them into a fresh `raw_images`
table the way `ingest_source` commits its chunks (`engine.chunked.commit_chunks`, with
`rows_to_commit` and its `CommittedRivals`). Nothing else: no listing, no Ray. Paired as
above, in this process's CPU seconds (Lance writes on its own threads), the table removed
between passes outside the timing (`PRX_BENCH_RIGHTS_INGEST_PAIRS`). There the readers run
as in the ingest, a table's 64 rows at a time (`rows_to_tables`); the `raw_row` level above
reads them row by row. `PRX_BENCH_RIGHTS_SETS=mixed` measures one set only. A pass of one set's
48 rows would be one commit per 48 rows, whose fixed cost (≈ 5 ms of CPU) an ingest pays
once per 1,024: a denominator padded by ≈ 14 %.

With `PRX_BENCH_RIGHTS_E2E_RUNS` (0 by default: it starts Ray, and is noisy), a secondary
check: `ingest_source` end to end on local Ray (2 CPUs) over the mixed shard above (its
441 XMP packets are more than the 256 a worker keeps findings for, so that a run read in
the same worker as the last reads them again), readers on and off alternating, in wall
seconds and the CPU seconds of this process and every process under it (Ray's workers).
"""

from __future__ import annotations

import json
import math
import os
import resource
import shutil
import statistics
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from bench.common import OUT, Figure, report
from bench.proc_memory import cpu_seconds, descendants
from prx_assets.defs.ingest import FRAGMENT_BYTES
from prx_assets.engine.chunked import ChunkedRun, CommitTarget, commit_chunks
from prx_assets.stages.ingest import rights
from prx_assets.stages.ingest.duplicate_keys import CommittedRivals, rows_to_commit
from prx_assets.stages.ingest.ingest import IngestOptions, _unit_rows
from prx_assets.stages.ingest.location import SourceLocation
from prx_assets.stages.ingest.raw_rows import (
    RAW_IMAGES_SCHEMA,
    FoundItem,
    raw_row,
    rows_to_tables,
)
from prx_assets.stages.ingest.sources import SourceSpec
from prx_assets.storage.lance_tables import FragmentPolicy
from prx_assets.storage.refs import TableRef
from prx_assets.testing import rights_fixtures as rf
from prx_assets.testing.tars import add_member

PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "camera", "immunohistochemistry",
          "hubble_deep_field", "retina", "brick", "moon", "cat", "colorwheel")
FORMATS = ("jpeg", "jpeg", "png", "webp")  # JPEG most of a crawl
PAIRS = int(os.environ.get("PRX_BENCH_RIGHTS_PAIRS", "300"))  # ≈ 8 s a set
INGEST_PAIRS = int(os.environ.get("PRX_BENCH_RIGHTS_INGEST_PAIRS", "20"))  # ≈ 30 s a set
E2E_RUNS = int(os.environ.get("PRX_BENCH_RIGHTS_E2E_RUNS", "0"))  # runs each way
# Which sets to measure (both by default): `mixed` alone for a change to the readers of
# XMP or C2PA, which the plain set never reaches.
SETS = tuple(os.environ.get("PRX_BENCH_RIGHTS_SETS", "plain,mixed").split(","))
SIGNATURE = "bench"  # the shard's unit signature (a listing's size and mtime)


def _sidecar(n: int) -> dict:
    return {"url": f"https://photos.example.org/{n}.jpg", "license": "cc-by-4.0",
            "attribution": "A. Photographer", "caption": "a photo"}


def _native(which: str, fmt: str) -> bytes:
    """A sample photo at its own size (not resized), encoded as `fmt`."""
    import io

    from PIL import Image
    from skimage import data

    out = io.BytesIO()
    Image.fromarray(getattr(data, which)()).convert("RGB").save(out, rf.FORMATS[fmt][1],
                                                                quality=90)
    return out.getvalue()


def photo_sets(work: Path, copies: int = 1) -> dict[str, list[FoundItem]]:
    plain = [FoundItem(key=f"{which}.{fmt}", data=_native(which, fmt))
             for which in PHOTOS for fmt in FORMATS]
    return {"plain": plain, "mixed": mixed_set(work, plain, copies)}


def mixed_set(work: Path, plain: list[FoundItem], copies: int) -> list[FoundItem]:
    """`plain` with metadata, `copies` times over: every copy its own XMP packets and C2PA
    manifests (nothing read once is read again), every item a crawler's sidecar."""
    mixed: dict[int, bytes] = {}
    tagged: list[tuple[Path, str, str]] = []
    for n in range(len(plain) * copies):
        m = n % len(plain)  # the same pattern in every copy
        fmt = FORMATS[m % len(FORMATS)]
        data = plain[m].data or b""
        if m % 10 == 0 and fmt == "jpeg":
            data = rf.sign_training_mining(data, "image/jpeg", {"ai_training": "notAllowed"})
        elif m % 2 == 0:
            path = work / f"{n}.{rf.FORMATS[fmt][0]}"
            path.write_bytes(data)
            value = "DMI-PROHIBITED-AIMLTRAINING" if m % 4 == 0 else "DMI-ALLOWED"
            tagged.append((path, "attribute" if m % 3 == 0 else "element", value))
        mixed[n] = data
    rf.tag_files(work, tagged, document_ids=True)  # one exiftool process
    for path, _, _ in tagged:
        mixed[int(path.stem)] = path.read_bytes()
        path.unlink()
    return [FoundItem(key=(f"{n // len(plain)}/" if n >= len(plain) else "")
                      + plain[n % len(plain)].key, data=mixed[n], meta=_sidecar(n))
            for n in range(len(mixed))]


def one_pass(items: list[FoundItem], read_rights: bool) -> float:
    """CPU seconds of one pass of `raw_row` over the set, every packet read as the first
    time (the findings kept per packet forgotten: in an ingest each file comes once)."""
    rights.forget_findings()
    start = time.thread_time()
    for item in items:
        raw_row("bench", item, source_license="cc0", read_rights=read_rights)
    return time.thread_time() - start


# ------------------------------------------------------------------ the ingest's level

def write_shard(path: Path, items: list[FoundItem]) -> Path:
    """The set as one WebDataset shard, as a crawler writes it: `<key>.<ext>` and
    `<key>.json` (the item's sidecar, or a crawler's plain one)."""
    with tarfile.open(path, "w") as tar:
        for n, item in enumerate(items):
            ext = rf.FORMATS[item.key.rpartition(".")[2]][0]
            add_member(tar, f"{n:06d}.{ext}", item.data or b"")
            add_member(tar, f"{n:06d}.json", json.dumps(dict(item.meta or _sidecar(n))).encode())
    return path


def shard_spec(folder: Path) -> SourceSpec:
    return SourceSpec(name="bench", kind="webdataset", uri=str(folder), license="cc0")


def raw_images_target(table: Path) -> CommitTarget:
    """A `raw_images` table as the ingest asset makes its target (keyed on id)."""
    return CommitTarget(TableRef.of(table), RAW_IMAGES_SCHEMA, ["id"],
                        FragmentPolicy(target_bytes=FRAGMENT_BYTES))


def chunked(tables: Iterable[pa.Table], rows: int) -> Iterator[pa.Table]:
    """`tables` cut again into chunks of `rows` rows (the last one shorter), as the ingest's
    runner cuts its Ray stage's output (`arrow_batches`)."""
    pending: list[pa.Table] = []
    count = 0
    for table in tables:
        pending.append(table)
        count += table.num_rows
        while count >= rows:
            whole = pa.concat_tables(pending)
            yield whole.slice(0, rows)
            pending = [whole.slice(rows)]
            count = pending[0].num_rows
    if count:
        yield pa.concat_tables(pending)


def ingest_once(shard: Path, table: Path, read_rights: bool
                ) -> tuple[float, float, ChunkedRun]:
    """Process CPU seconds of one ingest of `shard` into a fresh `raw_images` table at
    `table`, of them in user mode, and what the commits did: the tar read from disk, the
    rows built and made Arrow, the chunks committed as `ingest_source` commits them."""
    rights.forget_findings()
    spec, options = shard_spec(shard.parent), IngestOptions(read_rights=read_rights)
    location = SourceLocation.of(shard.parent)
    target = raw_images_target(table)
    rivals = CommittedRivals(target, lambda units: dict.fromkeys(units, SIGNATURE))
    start, user = time.process_time(), user_seconds()
    rows = _unit_rows(spec, location, shard.name, SIGNATURE, options)
    run = commit_chunks(chunked(rows_to_tables(rows), options.chunk_rows), target,
                        to_commit=lambda chunk: rows_to_commit(chunk, rivals))
    return time.process_time() - start, user_seconds() - user, run


def user_seconds() -> float:
    """This process's CPU seconds in user mode, every thread (getrusage: to the µs, where
    `os.times` counts 10 ms ticks, 2 % of a pass)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_utime


def ingest_pass(shard: Path, table: Path, read_rights: bool,
                user: dict[bool, list[float]]) -> float:
    """`ingest_once`'s seconds (its user-mode seconds added to `user`); the table removed
    after, outside the timing."""
    seconds, in_user_mode, run = ingest_once(shard, table, read_rights)
    shutil.rmtree(table)
    if run.committed == 0:
        raise RuntimeError(f"the ingest of {shard} committed nothing")
    user[read_rights].append(in_user_mode)
    return seconds


@dataclass(frozen=True)
class Cost:
    """Per-pair costs (with/without - 1) of one set, and the medians of each half."""

    costs: list[float]
    with_seconds: float
    without_seconds: float

    @classmethod
    def of_pairs(cls, with_seconds: list[float], without_seconds: list[float]) -> Cost:
        return cls([w / wo - 1 for w, wo in zip(with_seconds, without_seconds, strict=True)],
                   statistics.median(with_seconds), statistics.median(without_seconds))

    def quantile(self, q: float) -> float:
        ordered = sorted(self.costs)
        return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]

    def median_interval(self) -> tuple[float, float]:
        """95 % confidence interval of the median: the order statistics n/2 ± 0.98 √n."""
        ordered, n = sorted(self.costs), len(self.costs)
        half = 0.98 * math.sqrt(n)
        low, high = math.floor(n / 2 - half), math.ceil(n / 2 + half)
        return ordered[max(0, low)], ordered[min(n - 1, high)]


def paired_costs(one: Callable[[bool], float], pairs: int) -> Cost:
    """`pairs` pairs of passes (`one(read_rights)`: its CPU seconds), after one warm pass
    each way (imports, caches, c2pa's context)."""
    for read_rights in (True, False):
        one(read_rights)
    seconds: dict[bool, list[float]] = {True: [], False: []}
    for n in range(pairs):
        for flag in ((False, True) if n % 2 == 0 else (True, False)):
            seconds[flag].append(one(flag))
    return Cost.of_pairs(seconds[True], seconds[False])


def describe(cost: Cost, rows: int) -> str:
    low, high = cost.median_interval()
    return (f"without {rows / cost.without_seconds:.0f} rows/CPU-s, with "
            f"{rows / cost.with_seconds:.0f}: cost {cost.quantile(0.5) * 100:.2f} % "
            f"(95 % CI of the median {low * 100:.2f}-{high * 100:.2f}, quartiles "
            f"{cost.quantile(0.25) * 100:.2f}-{cost.quantile(0.75) * 100:.2f})")


def bench_set(name: str, items: list[FoundItem], pairs: int = PAIRS) -> Cost:
    reserved = sum(raw_row("bench", i)["reservation"] != "none" for i in items)
    load = os.getloadavg()[0]
    cost = paired_costs(lambda flag: one_pass(items, flag), pairs)
    megabytes = sum(len(i.data or b"") for i in items) / len(items) / 1e6
    print(f"rights readers, raw_row, {name} photos ({len(items)}, {megabytes:.2f} MB each on "
          f"average, {reserved} reserved), {pairs} pairs, load {load:.1f} -> "
          f"{os.getloadavg()[0]:.1f}: {describe(cost, len(items))}")
    return cost


def bench_ingest(name: str, items: list[FoundItem], work: Path,
                 pairs: int = INGEST_PAIRS) -> Cost:
    """The set's shard read, made rows and committed to Lance, readers on against off; in
    process CPU time, and in its user-mode part alone (the kernel's share, the pages the
    reads and writes touch, is the same work both ways but the noisiest; without it the
    readers' share is the larger)."""
    folder = work / f"shard-{name}"
    folder.mkdir()
    shard = write_shard(folder / f"{name}.tar", items)
    load = os.getloadavg()[0]
    user: dict[bool, list[float]] = {True: [], False: []}
    cost = paired_costs(lambda flag: ingest_pass(shard, work / f"{name}.lance", flag, user),
                        pairs)
    user_cost = Cost.of_pairs(user[True][1:], user[False][1:])  # the warm passes left out
    print(f"rights readers, ingest (shard -> rows -> Lance), {name} photos ({len(items)} "
          f"rows, {shard.stat().st_size / 1e6:.1f} MB shard), {pairs} pairs, load {load:.1f} "
          f"-> {os.getloadavg()[0]:.1f}: {describe(cost, len(items))}; in user time alone: "
          f"{describe(user_cost, len(items))}")
    return cost


# ------------------------------------------------------------------ end to end, on Ray

def tree_cpu() -> float:
    """CPU seconds of this process and every live process under it (Ray's workers), with
    what they reaped (a worker that ended between two reads is kept by its parent)."""
    return sum(cpu_seconds(pid) for pid in descendants(os.getpid()))


def e2e_runs(folder: Path, work: Path, runs: int) -> dict[bool, list[tuple[float, float]]]:
    """(wall, tree CPU) seconds of `runs` ingests each way of the shards in `folder` into a
    fresh table, alternating which goes first; a first pair warms Ray's workers."""
    from prx_assets.engine import ray_runtime
    from prx_assets.stages.ingest.ingest import ingest_source

    started = ray_runtime.connect(num_cpus=2)
    spec = shard_spec(folder)
    results: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    try:
        for n in range(runs + 1):
            for flag in ((False, True) if n % 2 == 0 else (True, False)):
                table = work / "e2e.lance"
                wall, cpu = time.perf_counter(), tree_cpu()
                ingest_source(spec, spec.uri, raw_images_target(table),
                              IngestOptions(read_rights=flag))
                wall, cpu = time.perf_counter() - wall, tree_cpu() - cpu
                shutil.rmtree(table)
                if n:
                    results[flag].append((wall, cpu))
    finally:
        if started:
            ray_runtime.disconnect()
    return results


def bench_e2e(items: list[FoundItem], work: Path, runs: int = E2E_RUNS) -> None:
    folder = work / "shard-e2e"
    folder.mkdir()
    write_shard(folder / "mixed.tar", items)
    load = os.getloadavg()[0]
    results = e2e_runs(folder, work, runs)
    print(f"rights readers, ingest_source on Ray (2 CPUs), mixed photos ({len(items)} rows, "
          f"one shard), {runs} runs each way, load {load:.1f} -> {os.getloadavg()[0]:.1f}:")
    for what, index in (("wall", 0), ("CPU of the process tree", 1)):
        on = [r[index] for r in results[True]]
        off = [r[index] for r in results[False]]
        ratios = sorted(a / b - 1 for a, b in zip(on, off, strict=True))
        print(f"  {what}: without {statistics.median(off):.2f} s (range {min(off):.2f}-"
              f"{max(off):.2f}), with {statistics.median(on):.2f} s ({min(on):.2f}-"
              f"{max(on):.2f}): medians {statistics.median(on) / statistics.median(off) - 1:+.1%}"
              f", per pair {', '.join(f'{r:+.1%}' for r in ratios)}")


def main() -> None:
    if not rf.exiftool_available():
        print("rights: exiftool not installed (make install); skipped")
        return
    OUT.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-rights-", dir=OUT))
    try:
        sets = photo_sets(work)
        figures = []
        for name, items in sets.items():
            if name not in SETS:
                continue
            cost = bench_set(name, items)
            figures.append(Figure("ingest", f"rows/CPU-s, rights, {name}",
                                  len(items) / cost.with_seconds, "ingest rows without readers",
                                  len(items) / cost.without_seconds, "row/s"))
        copies = IngestOptions().chunk_rows // len(sets["plain"])  # one commit's rows
        chunk_sets = {"plain": sets["plain"] * copies,
                      "mixed": mixed_set(work, sets["plain"], copies)}
        for name, items in chunk_sets.items():
            if name not in SETS:
                continue
            cost = bench_ingest(name, items, work)
            figures.append(Figure("ingest", f"shard->Lance rows/CPU-s, rights, {name}",
                                  len(items) / cost.with_seconds, "the same without readers",
                                  len(items) / cost.without_seconds, "row/s"))
        if E2E_RUNS:
            bench_e2e(chunk_sets["mixed"], work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(figures, "rights")


if __name__ == "__main__":
    main()
