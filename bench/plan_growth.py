"""The driver's own cost of an `mds_shards` run as a source grows: planning, diffing and
the skipped-id pass, on metadata-only rows (no image bytes, no caption text).

Per size N, one source's tables are made once (metadata columns only): `bucketed_images`
(N kept rows in 3 tiers x 10 shapes: 30 leaves), `captions` (one usable row per id, with
the BTREE on `id` its stage keeps) and the mapping table `mds_samples` written by the
stage's own `mapping_rows` / `overwrite_rows` (2,000 samples a shard) with 0.1 % of its
fingerprints changed and 0.1 % more ids than the plan (rows to write and a stale set of
0.2 %), plus dedup sidecars on 1 % of the shards.
Then each phase runs in a fresh interpreter (one process per phase and size, so the peaks
are its own):

- **plan**: `plan_samples`, `split_leaves`, `part_specs` of every leaf and the full
  build's `mapping_rows`: what the driver does before the Ray tasks of a full build;
- **grouped**: the same full build planned in groups of at most 10⁵ kept rows (the stage's
  `plan_rows`, 10⁶ by default): the counting pass, then per group its plan, part specs and
  mapping rows written as uncommitted fragments;
- **diff**: `mapping_for_append` and `plan_delta` (new, changed, stale and removed ids)
  against the plan (made before the clock);
- **handed**: the same diff for a run handed its inputs' changes (`handed_delta` of the
  ids `touched_ids` finds from the tree's record): 0.3 % of the ids touched;
- **compared**: plan and diff of a run that must compare every id (no record: an input was
  compacted) in groups of at most `GROUP_ROWS` kept rows (`groups.compare_groups`);
- **skipped**: `skipped_ids` (what a rewrite reads from the sidecars and the mapping).

Printed per phase and size: seconds per row, the peak of Python allocations (tracemalloc:
the Python objects the phase holds at once) and the growth of the process's peak RSS
(Python objects and Arrow buffers), each as a ratio to the smallest size. `--code DIR`
(repeatable) runs the phases against another copy of `prx_assets` (e.g. an export of the
commit before) and prints its figures too, then each figure against the first code's.

    python -m bench.plan_growth --sizes 1e4,1e5,1e6 --code /tmp/before
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa

from bench.common import Figure, report

DEFAULT_SIZES = (10_000, 100_000)  # a smoke run; the note uses 1e4,1e5,1e6
PHASES = ("plan", "grouped", "diff", "handed", "compared", "skipped")
GROUP_ROWS = 100_000  # the grouped phases' `plan_rows` (the stage's default is 10⁶)
SOURCE = "bench"
CAPTION_FILTER = "caption_version = 'v1' AND status = 'ok'"
TIERS = (256, 512, 1024)
SHAPES = ((1, 1), (4, 3), (3, 4), (16, 9), (9, 16), (3, 2), (2, 3), (2, 1), (1, 2), (5, 4))
SHARD_SAMPLES = 2_000
WARM_ROWS = 1_000  # the source each phase runs on first, untimed
CHANGED_SHARE = 0.001  # of the mapping: fingerprints changed, and ids the plan lost
SIDECAR_SHARE = 0.01  # of the shards: a dedup sidecar skipping 5 % of their samples
HERE = Path(__file__).resolve().parent.parent


def sample_ids(n: int, offset: int = 0) -> pa.Array:
    return pa.array([f"{SOURCE}:{hashlib.blake2b(str(i).encode(), digest_size=12).hexdigest()}"
                     for i in range(offset, offset + n)], pa.string())


def bucketed_rows(n: int) -> pa.Table:
    rng = np.random.default_rng(n)
    tier = np.array(TIERS, np.int32)[rng.integers(0, len(TIERS), n)]
    ratio = rng.integers(0, len(SHAPES), n)
    w = np.array([s[0] for s in SHAPES])[ratio]
    h = np.array([s[1] for s in SHAPES])[ratio]
    scale = tier / np.maximum(w, h)
    width, height = (w * scale).astype(np.int32), (h * scale).astype(np.int32)
    return pa.table({
        "id": sample_ids(n), "status": pa.repeat(pa.scalar("ok"), n),
        "tier": pa.array(tier), "width": pa.array(width), "height": pa.array(height),
        "original_width": pa.array(width * 3), "original_height": pa.array(height * 3),
        "phash": pa.array(rng.integers(0, 1 << 62, n)),
        "pixels": pa.array((width * height).astype(np.int64)),
    })


def caption_rows(ids: pa.Array) -> pa.Table:
    n = len(ids)
    return pa.table({
        "id": ids, "caption_version": pa.repeat(pa.scalar("v1"), n),
        "status": pa.repeat(pa.scalar("ok"), n),
        "n_words": pa.array(np.full(n, 30, np.int32)),
        "created_at": pa.array(np.full(n, 1_700_000_000_000_000, np.int64),
                               pa.timestamp("us", tz="UTC")),
    })


def fake_shards(samples: int) -> list[dict]:
    """Index entries as `MDSWriter` returns them, as far as the mapping reads them."""
    counts = [SHARD_SAMPLES] * (samples // SHARD_SAMPLES)
    if samples % SHARD_SAMPLES:
        counts.append(samples % SHARD_SAMPLES)
    return [{"samples": c, "raw_data": {"basename": f"shard.{i:05d}.mds"}}
            for i, c in enumerate(counts)]


def inputs_of(folder: Path):
    from prx_assets.stages.shards.plan import SampleInputs
    from prx_assets.storage.refs import TableRef

    return SampleInputs(TableRef.of(folder / "bucketed.lance"),
                        TableRef.of(folder / "captions.lance"), CAPTION_FILTER)


def make_source(folder: Path, n: int) -> None:
    """One source's tables and sidecars at size `n` (the stage's own mapping writer)."""
    import lance

    from prx_assets.stages.shards.mapping import MDS_SAMPLES_SCHEMA, mapping_rows
    from prx_assets.stages.shards.plan import plan_samples, split_leaves
    from prx_assets.storage.lance_tables import overwrite_rows
    from prx_assets.storage.refs import TableRef
    from prx_assets.storage.sidecars import REASON_DEDUP, sidecar_name, write_sidecar
    from prx_assets.storage.trees import leaf_name

    bucketed = bucketed_rows(n)
    lance.write_dataset(bucketed, folder / "bucketed.lance")
    captions = lance.write_dataset(caption_rows(bucketed["id"].combine_chunks()),
                                   folder / "captions.lance")
    # As the captions stage keeps it (`storage.key_index`): what lookups by id go through.
    captions.create_scalar_index("id", "BTREE", name="id_idx")
    plan, _ = plan_samples(inputs_of(folder))
    mapping = pa.concat_tables(mapping_rows(SOURCE, key, rows, fake_shards(rows.num_rows), "v1")
                               for key, rows in split_leaves(plan))
    overwrite_rows(TableRef.of(folder / "mapping.lance"), with_changes(mapping, n),
                   MDS_SAMPLES_SCHEMA)
    rng = np.random.default_rng(0)
    for key, rows in split_leaves(plan):
        for entry in fake_shards(rows.num_rows):
            if rng.random() < SIDECAR_SHARE:
                skipped = rng.choice(entry["samples"], max(1, entry["samples"] // 20), False)
                write_sidecar(folder / "tree" / leaf_name(*key)
                              / sidecar_name(entry["raw_data"]["basename"]),
                              {REASON_DEDUP: skipped.tolist()})
        (folder / "tree" / leaf_name(*key)).mkdir(parents=True, exist_ok=True)


def with_changes(mapping: pa.Table, n: int) -> pa.Table:
    """The mapping as an earlier tree left it: 0.1 % of fingerprints differ (changed
    samples) and 0.1 % more ids (samples gone from the inputs since)."""
    changed = max(1, int(n * CHANGED_SHARE))
    fingerprints = mapping["fingerprint"].to_numpy().copy()
    fingerprints[::max(1, n // changed)] += 1
    mapping = mapping.set_column(mapping.schema.get_field_index("fingerprint"), "fingerprint",
                                 pa.array(fingerprints, pa.int64()))
    gone = mapping.slice(0, changed).set_column(0, "id", sample_ids(changed, offset=n))
    return pa.concat_tables([mapping, gone], promote_options="permissive")


# -- one phase, in its own interpreter ---------------------------------------------------------

def phase_plan(folder: Path) -> Callable[[], object]:
    from prx_assets.stages.shards.mapping import mapping_rows
    from prx_assets.stages.shards.parts import part_specs
    from prx_assets.stages.shards.plan import plan_samples, split_leaves
    from prx_assets.storage.refs import Location
    from prx_assets.storage.trees import leaf_name

    def run() -> object:
        plan, _ = plan_samples(inputs_of(folder))
        leaves = split_leaves(plan)
        specs = [part_specs(rows, Location.of(folder / "staging") / leaf_name(*key), 50_000)
                 for key, rows in leaves]
        mapping = [mapping_rows(SOURCE, key, rows, fake_shards(rows.num_rows), "v2")
                   for key, rows in leaves]
        return plan, leaves, specs, mapping

    return run


def phase_grouped(folder: Path) -> Callable[[], object]:
    """What the driver does before and between the Ray tasks of a full build planned in
    groups of at most `GROUP_ROWS` kept rows (`stages.shards.groups`): the counting pass,
    the groups (a cut leaf's sample pass), then per group the plan, its leaves and part
    specs and its mapping rows written as uncommitted fragments, one group held at a time."""
    from prx_assets.stages.shards.groups import kept_per_leaf, plan_groups
    from prx_assets.stages.shards.mapping import mapping_rows, stage_fragments
    from prx_assets.stages.shards.parts import part_specs
    from prx_assets.stages.shards.plan import plan_samples, split_leaves
    from prx_assets.storage.refs import Location, TableRef
    from prx_assets.storage.trees import leaf_name

    inputs = inputs_of(folder).pinned()
    scratch = TableRef.of(Path(tempfile.mkdtemp(dir=folder)) / "mapping.lance")

    def run() -> object:
        groups = plan_groups(inputs, kept_per_leaf(inputs), GROUP_ROWS)
        fragments = []
        for group in groups:
            plan, _ = plan_samples(inputs, where=group.where(len(groups) == 1))
            for key, rows in split_leaves(plan):
                part_specs(rows, Location.of(folder / "staging") / leaf_name(*key), 50_000)
                fragments += stage_fragments(scratch, mapping_rows(
                    SOURCE, key, rows, fake_shards(rows.num_rows), "v2"))
        return len(groups), len(fragments)

    return run


def phase_diff(folder: Path) -> Callable[[], object]:
    from prx_assets.stages.shards.mapping import mapping_for_append
    from prx_assets.stages.shards.plan import plan_delta, plan_samples
    from prx_assets.storage.refs import TableRef

    plan, _ = plan_samples(inputs_of(folder))  # upstream of the diff: before the clock

    def run() -> object:
        previous = mapping_for_append(TableRef.of(folder / "mapping.lance"))
        assert previous is not None
        return plan_delta(plan, previous)

    return run


def phase_handed(folder: Path) -> Callable[[], object]:
    """The `diff` of an incremental run handed its inputs' changes (`stages.shards.handed`):
    a copy of the inputs, the mapping of their exact plan and the manifest's record of
    them; then (before the clock) 0.1 % of the ids appended, 0.1 % deleted and 0.1 %
    changed (a new phash). Timed: finding the ids touched and their delta."""
    import lance

    from prx_assets.stages.shards.handed import consumed_inputs, handed_delta, touched_ids
    from prx_assets.stages.shards.mapping import MDS_SAMPLES_SCHEMA, mapping_rows
    from prx_assets.stages.shards.plan import SampleInputs, plan_samples, split_leaves
    from prx_assets.storage.filters import in_filter
    from prx_assets.storage.lance_tables import overwrite_rows
    from prx_assets.storage.refs import TableRef

    copy = Path(tempfile.mkdtemp(dir=folder, prefix="handed-"))  # the warm source's: reused
    for name in ("bucketed", "captions"):
        shutil.copytree(folder / f"{name}.lance", copy / f"{name}.lance")
    inputs = SampleInputs(TableRef.of(copy / "bucketed.lance"),
                          TableRef.of(copy / "captions.lance"), CAPTION_FILTER)
    plan, _ = plan_samples(inputs)
    mapping = TableRef.of(copy / "mapping.lance")
    overwrite_rows(mapping, pa.concat_tables(
        mapping_rows(SOURCE, key, rows, fake_shards(rows.num_rows), "v1")
        for key, rows in split_leaves(plan)), MDS_SAMPLES_SCHEMA)
    records = consumed_inputs(inputs)
    n = plan.num_rows
    k = max(1, int(n * CHANGED_SHARE))
    new = bucketed_rows(n + k).slice(n).set_column(0, "id", sample_ids(k, offset=2 * n))
    lance.write_dataset(new, inputs.bucketed.uri, mode="append")
    lance.write_dataset(caption_rows(new["id"]), inputs.captions.uri, mode="append")
    ids = plan["id"].to_pylist()
    bucketed = inputs.bucketed.open()
    bucketed.delete(in_filter("id", ids[:k]))
    bucketed.update({"phash": "phash + 1"}, where=in_filter("id", ids[k:2 * k]))
    pinned = inputs.pinned()

    def run() -> object:
        touched = touched_ids(pinned, records)
        assert touched is not None and len(touched) == 3 * k, "handed every change"
        return handed_delta(pinned, mapping, touched)

    return run


def phase_compared(folder: Path) -> Callable[[], object]:
    """`plan` and `diff` as an incremental run not handed its inputs' changes does them:
    group by group, each group's plan against the mapping rows of its leaves."""
    import dataclasses

    from prx_assets.stages.shards.groups import compare_groups
    from prx_assets.stages.shards.plan import Build, WriteOptions
    from prx_assets.storage.layout import Storage
    from prx_assets.storage.refs import TableRef
    from prx_assets.storage.trees import tree_store

    mapping = TableRef.of(folder / "mapping.lance")
    build = Build(tree_store(Storage(folder), SOURCE, lambda _: None), mapping,
                  inputs_of(folder).pinned(),
                  dataclasses.replace(WriteOptions(), plan_rows=GROUP_ROWS),
                  mapping.latest_version())
    return lambda: compare_groups(build)


def phase_skipped(folder: Path) -> Callable[[], object]:
    from prx_assets.stages.skip_lists.skip_lists import skipped_ids
    from prx_assets.storage.refs import TableRef

    return lambda: skipped_ids(folder / "tree", TableRef.of(folder / "mapping.lance"))


def status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    return 0


def reset_peak_rss() -> None:
    """Start VmHWM afresh. (Not `ru_maxrss`: Linux carries it across exec, so a child of a
    big parent reports the parent's size.)"""
    Path("/proc/self/clear_refs").write_text("5")


def measure_phase(phase: str, folder: Path, warm: Path) -> dict:
    """Seconds and peak RSS growth of one run, after a run on a tiny source (`warm`: the
    imports and lazy set-ups are not the phase's cost); then the Python allocation peak of
    a second run (tracemalloc slows allocation-heavy code, so it is not on while timing)."""
    import prx_assets

    phases = {"plan": phase_plan, "grouped": phase_grouped, "diff": phase_diff,
              "handed": phase_handed, "compared": phase_compared,
              "skipped": phase_skipped}
    phases[phase](warm)()
    run = phases[phase](folder)
    reset_peak_rss()
    before = status_kb("VmRSS")
    started = time.perf_counter()
    result = run()
    seconds = time.perf_counter() - started
    rss_growth = status_kb("VmHWM") - before
    del result
    tracemalloc.start()
    run()
    _, python_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {"seconds": seconds, "rss_kb": max(0, rss_growth), "python_bytes": python_peak,
            "code": str(Path(prx_assets.__file__).parent.parent)}


# -- the driver --------------------------------------------------------------------------------

def run_phase(phase: str, folder: Path, warm: Path, code: Path | None) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [*([str(code)] if code else []), str(HERE), os.environ.get("PYTHONPATH", "")]))
    # Not run from the repository: `-m` puts the working folder first on the path, and the
    # code under test must come from `code`.
    out = subprocess.run([sys.executable, "-m", "bench.plan_growth", "--measure", phase,
                          "--folder", str(folder), "--warm", str(warm)], env=env,
                         cwd=folder, check=True, capture_output=True, text=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if Path(result["code"]) != (code or HERE):  # the figures would be of the wrong code
        raise RuntimeError(f"measured {result['code']}, meant {code or HERE}")
    return result


def figures(results: dict[str, dict[str, dict[int, dict]]]) -> list[Figure]:
    """Per code, phase and size: us/row, Python peak and RSS growth against the smallest
    size; then each later code's figures against the first code's at the same size."""
    out: list[Figure] = []
    codes = list(results)
    for code in codes:
        for phase, by_size in results[code].items():
            first_n = min(by_size)
            first = by_size[first_n]
            base = f"{first_n:.0e} rows"
            for n, r in sorted(by_size.items()):
                at = f"{code} {phase} @{n:.0e}"
                out += [
                    Figure("plan", f"{at} us/row", 1e6 * r["seconds"] / n, base,
                           1e6 * first["seconds"] / first_n, "us/row"),
                    Figure("plan", f"{at} py peak", r["python_bytes"] / 2**20, base,
                           first["python_bytes"] / 2**20, "MiB"),
                    Figure("plan", f"{at} rss peak", r["rss_kb"] / 1024, base,
                           first["rss_kb"] / 1024, "MiB"),
                ]
    for code in codes:
        out += against_plan_and_diff(code, results[code], "handed")
        out += against_plan_and_diff(code, results[code], "compared")
    for code in codes[1:]:
        for phase, by_size in results[code].items():
            for n, r in sorted(by_size.items()):
                ref = results[codes[0]][phase][n]
                at = f"{phase} @{n:.0e} {code}"
                out += [Figure("plan", f"{at} s", r["seconds"], codes[0], ref["seconds"], "s"),
                        Figure("plan", f"{at} py peak", r["python_bytes"] / 2**20, codes[0],
                               ref["python_bytes"] / 2**20, "MiB"),
                        Figure("plan", f"{at} rss peak", r["rss_kb"] / 1024, codes[0],
                               ref["rss_kb"] / 1024, "MiB")]
    return out


def against_plan_and_diff(code: str, by_phase: dict[str, dict[int, dict]], phase: str
                          ) -> list[Figure]:
    """An incremental run's planning (`handed` its inputs' changes, or `compared` in
    groups) against the same run comparing every id at once: the plan, then the diff."""
    if not {"plan", "diff", phase} <= set(by_phase):
        return []
    out = []
    for n, result in sorted(by_phase[phase].items()):
        plan, diff = by_phase["plan"][n], by_phase["diff"][n]
        at = f"{code} {phase} vs plan+diff @{n:.0e}"
        out += [Figure("plan", f"{at} s", result["seconds"], "plan + diff",
                       plan["seconds"] + diff["seconds"], "s"),
                Figure("plan", f"{at} rss peak", result["rss_kb"] / 1024, "plan + diff",
                       max(plan["rss_kb"], diff["rss_kb"]) / 1024, "MiB")]
    return out


def run(sizes: list[int], codes: list[Path | None], phases: tuple[str, ...] = PHASES
        ) -> dict[str, dict[str, dict[int, dict]]]:
    """Every phase at every size for every code, on tables made once per size (in a
    temporary folder, removed after)."""
    work = Path(tempfile.mkdtemp(prefix="prx-plan-growth-"))
    results: dict[str, dict[str, dict[int, dict]]] = {}
    try:
        warm = work / "warm"
        warm.mkdir()
        make_source(warm, WARM_ROWS)
        for n in sizes:
            folder = work / str(n)
            folder.mkdir()
            make_source(folder, n)
            for code in codes:
                name = "this" if code is None else code.name
                for phase in phases:
                    result = run_phase(phase, folder, warm, code)
                    results.setdefault(name, {}).setdefault(phase, {})[n] = result
                    # As it goes: a run cut short still shows the sizes it finished.
                    print(json.dumps({"code": name, "phase": phase, "rows": n, **result}),
                          file=sys.stderr, flush=True)
            shutil.rmtree(folder, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return results


def parse_sizes(text: str) -> list[int]:
    return sorted({int(float(part)) for part in text.split(",") if part.strip()})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)))
    parser.add_argument("--code", action="append", default=[], type=Path,
                        help="another prx_assets copy's parent folder to measure as well")
    parser.add_argument("--measure", choices=PHASES, help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--warm", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv if argv is not None else [])
    if args.measure:
        print(json.dumps(measure_phase(args.measure, args.folder, args.warm)))
        return
    results = run(parse_sizes(args.sizes), [None, *args.code])
    report(figures(results), "plan_growth")


if __name__ == "__main__":
    main(sys.argv[1:])
