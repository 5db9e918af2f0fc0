"""A seeded fault soak: a random schedule of source changes, hostile files, opt-outs, runs,
kills and a reader, with an invariant checker after every cycle.

    python -m bench.soak --cycles N --seed S [--dir DIR]

One folder source (`web`, generated JPEGs with caption sidecars) on local disk, a Dagster
instance of its own, every run a real Dagster run in its own process group (as `dagster
dev` starts them: `testing.fault_runs`). Each cycle, drawn from the seed:

- the folder changes: files added, removed, replaced (same name, other bytes), hostile
  files (empty, truncated, not an image) added or removed;
- an opt-out of a published sample through the CLI (`prx-assets opt-out`);
- the runs: source_job, dedup_job and skip_lists_job in turn, and one of: a plain run, two
  source_job runs of the partition at once (as a sensor and a person start them), or a
  source_job armed at a random failpoint and SIGKILLed there (then the plain runs);
- a trainer's reader lease on the current tree, taken before the runs and checked after.

The invariants, after every cycle (`check`): the published tree is whole (every indexed
shard present with its size, the mapping naming only versions the tree holds: `verify`);
the tree held by the reader lease is whole too; no table holds a key twice; a fresh loader
never yields an opted-out sample nor one sample twice in an epoch, with and without the
loader's own opt-out guard (the sidecars alone); no credential value set in the runs'
environment appears in any file under the data root or the Dagster instance.

A violation prints the seed, the cycle, the schedule so far and the invariant, and the run
exits 1. Everything random comes from `--seed`: the same seed replays the same schedule
(run times and the machine's load aside). `main()` (bench/run_all.py) runs a short soak.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import Figure, report

SOURCE = "web"
FAILPOINTS = ("ingest.expand_units", "ingest.chunk_committed", "images.chunk_committed",
              "captions.chunk_committed", "mds.before_mapping_commit", "mds.before_publish")
CANARIES = {"OPENAI_API_KEY": "sk-soak-canary-openai-0123456789",
            "AWS_SECRET_ACCESS_KEY": "soak-canary-aws-secret-0123456789"}
KEYS = {"raw_images": ["id"], "bucketed_images": ["id"], "phashes": ["id"],
        "mds_samples": ["id"], "captions": ["id", "caption_version"]}
RUN_TIMEOUT_S = 900
DEFAULT_CYCLES = 3  # bench/run_all.py: a few minutes


class Violation(AssertionError):
    """An invariant failed after a cycle."""


@dataclass
class Soak:
    root: Path
    seed: int
    rng: random.Random = field(init=False)
    schedule: list[str] = field(default_factory=list)
    opted: set[str] = field(default_factory=set)
    runs: int = 0
    faults: int = 0
    failed_runs: int = 0
    retries: int = 0
    cycle_seconds: list[float] = field(default_factory=list)
    files_made: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.folder = self.root / "sources" / SOURCE
        self.data_root = self.root / "data"
        self.home = self.root / "home"
        self.logs = self.root / "logs"

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        from prx_assets.testing.fault_runs import write_instance_config
        from prx_assets.testing.sources import folder_source, write_sources

        for folder in (self.folder, self.data_root, self.logs):
            folder.mkdir(parents=True, exist_ok=True)
        write_instance_config(self.home)
        self.sources = write_sources(self.root / "sources.yaml",
                                     [folder_source(SOURCE, self.folder)])
        for _ in range(8):
            self.add_image()
        os.environ.update(PRX_DATA_ROOT=str(self.data_root), PRX_SOURCES=str(self.sources),
                          DAGSTER_HOME=str(self.home), **CANARIES)
        self.start_factory()

    def start_factory(self) -> None:
        """One Ray for the whole soak (embedded, the credentials withheld from it), the code
        location's definitions and the instance, loaded once: the plain runs execute in this
        process, as `dagster.materialize` in a script does, each a real run of the instance
        on the shared Ray (its workers warm from run to run, as on a cluster); the runs that
        are killed or run beside another are processes of their own that join this Ray."""
        import ray

        from prx_assets.definitions import build_defs
        from prx_assets.engine import ray_runtime
        from prx_assets.testing.fault_runs import open_instance

        ray_runtime.connect()
        self.ray_address = ray.get_runtime_context().gcs_address
        self.defs = build_defs(self.sources)
        self.instance = open_instance(self.home)

    # ------------------------------------------------------------------ source changes
    def add_image(self, name: str | None = None) -> str:
        from prx_assets.testing.images import jpeg_bytes

        self.files_made += 1
        name = name or f"img{self.files_made:04d}.jpg"
        # Tier 512 at least (a smaller image is `too_small`): every image reaches the tree.
        width, height = self.rng.choice([(512, 384), (640, 480), (600, 600), (480, 640)])
        (self.folder / name).write_bytes(jpeg_bytes(width, height, self.rng.randrange(10**6)))
        (self.folder / name).with_suffix(".txt").write_text(
            f"a generated test pattern number {self.rng.randrange(10**6)}")
        return name

    def images(self) -> list[str]:
        return sorted(p.name for p in self.folder.glob("img*.jpg"))

    def change_source(self) -> None:
        for _ in range(self.rng.randint(1, 3)):
            action = self.rng.choice(["add", "add", "remove", "replace", "hostile",
                                      "unhostile"])
            images, hostile = self.images(), sorted(self.folder.glob("bad*"))
            if action == "add" or (action in ("remove", "replace") and len(images) < 4):
                self.note(f"add {self.add_image()}")
            elif action == "remove":
                name = self.rng.choice(images)
                (self.folder / name).unlink()
                (self.folder / name).with_suffix(".txt").unlink(missing_ok=True)
                self.note(f"remove {name}")
            elif action == "replace":
                self.note(f"replace {self.add_image(self.rng.choice(images))}")
            elif action == "hostile" or not hostile:
                self.note(f"hostile {self.add_hostile()}")
            else:
                victim = self.rng.choice(hostile)
                victim.unlink()
                self.note(f"remove hostile {victim.name}")

    def add_hostile(self) -> str:
        from prx_assets.testing.images import jpeg_bytes

        kind = self.rng.choice(["empty", "truncated", "text", "png_header"])
        name = f"bad{self.rng.randrange(10**6):06d}-{kind}.jpg"
        data = {"empty": b"", "truncated": jpeg_bytes(300, 300, 1)[:200],
                "text": b"this is not an image\n" * 10,
                "png_header": b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x7f\xff\xff\xff"
                              b"\x7f\xff\xff\xff\x08\x02\x00\x00\x00"}[kind]
        (self.folder / name).write_bytes(data)
        return name

    # ------------------------------------------------------------------ opt-outs
    def opt_out(self) -> None:
        from prx_assets import cli
        from prx_assets.storage.layout import Storage
        from prx_assets.storage.tables import MDS_SAMPLES

        mapping = Storage(self.data_root).table(MDS_SAMPLES, SOURCE)
        if not mapping.exists():
            return
        ids = sorted(set(mapping.to_table(columns=["id"])["id"].to_pylist()) - self.opted)
        if not ids:
            return
        chosen = self.rng.choice(ids)
        with contextlib.redirect_stdout(io.StringIO()):
            status = cli.main(["opt-out", chosen, "--reason", f"soak {self.seed}"])
        if status != 0:
            raise self.violation("the CLI refused an opt-out of a published sample")
        self.opted.add(chosen)
        self.note(f"opt-out {chosen} (cli)")

    # ------------------------------------------------------------------ runs
    def run_here(self, job: str, partition: str | None) -> bool:
        """One run of `job` in this process (its partition tagged as a sensor's run is)."""
        from prx_assets.testing.fault_runs import job_subset

        self.runs += 1
        result = job_subset(self.defs, job, []).execute_in_process(
            partition_key=partition, instance=self.instance, raise_on_error=False,
            tags={"prx/trigger": "soak", "prx/trigger_reason": f"seed {self.seed}"})
        self.count_retries(result.run_id)
        if not result.success:
            self.failed_runs += 1
        return result.success

    def start(self, job: str, partition: str | None, failpoint: str | None = None):
        from prx_assets.testing.fault_runs import RunProcess, RunSpec

        spec = RunSpec(self.sources, job, partition, self.home, self.data_root,
                       ray_address=self.ray_address)
        if failpoint:
            spec.arm(failpoint, self.logs)
        self.runs += 1
        return RunProcess(spec, self.logs)

    def finish(self, run) -> bool:
        result = run.wait(RUN_TIMEOUT_S)
        self.count_retries(run.spec.run_id)
        if not result["success"]:
            self.failed_runs += 1
            self.note(f"  {run.spec.job} failed (log {run.log.name})")
        return bool(result["success"])

    def count_retries(self, run_id: str) -> None:
        """Steps Dagster ran again (`RetryRequested`: a transient failure) in the run."""
        from dagster import DagsterEventType

        records = self.instance.get_records_for_run(
            run_id, of_type=DagsterEventType.STEP_UP_FOR_RETRY).records
        if records:
            self.retries += len(records)
            self.note(f"  {len(records)} step retr{'y' if len(records) == 1 else 'ies'} in run "
                      f"{run_id[:8]}")

    def killed_run(self) -> None:
        from prx_assets.testing.fault_runs import mark_killed_run_failed, wait_for_failpoint

        point = self.rng.choice(FAILPOINTS)
        run = self.start("source_job", SOURCE, point)
        try:
            wait_for_failpoint(run)
        except AssertionError:  # the run passed nowhere near it (nothing to do there)
            self.note(f"source_job armed at {point}: ended without reaching it")
            self.finish(run)
            return
        run.kill()
        self.faults += 1
        mark_killed_run_failed(self.instance, run.spec.run_id)
        self.note(f"source_job SIGKILLed at {point}")

    def two_at_once(self) -> None:
        first, second = self.start("source_job", SOURCE), self.start("source_job", SOURCE)
        both = [self.finish(first), self.finish(second)]
        self.note(f"two source_job runs at once: {both}")
        if not any(both):
            raise self.violation("two runs of one partition: neither succeeded")

    def plain_runs(self) -> None:
        for job, partition in (("source_job", SOURCE), ("dedup_job", None),
                               ("skip_lists_job", SOURCE)):
            if not self.run_here(job, partition):
                raise self.violation(f"{job} failed on a plain run (its events in the "
                                     f"instance at {self.home})")
        self.note("source_job, dedup_job, skip_lists_job")

    # ------------------------------------------------------------------ one cycle
    def cycle(self, number: int) -> None:
        self.number = number
        started = time.perf_counter()
        self.note(f"-- cycle {number}")
        self.change_source()
        if self.rng.random() < 0.5:
            self.opt_out()
        lease = self.hold_tree()
        # Mostly plain cycles (runs in this process, seconds); the others start processes.
        kind = self.rng.choices(["plain", "twice", "kill"], weights=[5, 2, 3])[0]
        if kind == "twice":
            self.two_at_once()
        elif kind == "kill":
            self.killed_run()
        self.plain_runs()
        self.check(lease)
        self.cycle_seconds.append(time.perf_counter() - started)
        self.note(f"cycle {number}: {self.cycle_seconds[-1]:.1f} s")

    def hold_tree(self):
        from prx_assets.loader.streams import hold_trees
        from prx_assets.storage.trees import source_trees

        if source_trees(self.data_root / "mds", SOURCE).current_version() is None:
            return None
        trees, keeper = hold_trees(self.data_root / "mds", {SOURCE: 1.0})
        self.note(f"reader lease on tree {trees[SOURCE].name}")
        return trees[SOURCE], keeper

    # ------------------------------------------------------------------ invariants
    def check(self, lease) -> None:
        from prx_assets.stages.shards import verify

        checks, problems = verify.verify_tree(self.data_root, SOURCE)
        if problems or not all(c.ok for c in checks):
            raise self.violation(f"the current tree is not whole: {problems} "
                                 f"{[c for c in checks if not c.ok]}")
        if lease is not None:
            tree, keeper = lease
            self.check_leased_tree(tree)
            keeper.release()
        self.check_unique_keys()
        for guarded in (True, False):
            self.check_loader(guarded)
        self.check_no_credentials()

    def check_leased_tree(self, tree) -> None:
        import json

        from prx_assets.storage.trees import leaf_names

        for leaf in leaf_names(tree):
            for shard in json.loads((tree / leaf / "index.json").read_text())["shards"]:
                path = (tree / leaf / shard["raw_data"]["basename"]).path
                if not path.exists() or path.stat().st_size != shard["raw_data"]["bytes"]:
                    raise self.violation(f"tree {tree.name} under a reader lease lost {path}")

    def check_unique_keys(self) -> None:
        import pyarrow.compute as pc

        from prx_assets.storage.keyed_writes import key_strings
        from prx_assets.storage.layout import Storage

        storage = Storage(self.data_root)
        for table, keys in KEYS.items():
            ref = storage.table(table, SOURCE)
            if not ref.exists():
                continue
            rows = ref.to_table(columns=keys)
            strings = key_strings(rows, keys)
            if pc.count_distinct(strings).as_py() != rows.num_rows:
                raise self.violation(f"{table} holds a key twice")

    def check_loader(self, guarded: bool) -> None:
        from prx_assets.loader import build_dataset
        from prx_assets.storage.trees import leaf_names, source_trees
        from prx_assets.testing.shared_memory import release_shared_memory

        tree = source_trees(self.data_root / "mds", SOURCE).current_tree()
        for tier in sorted({int(name.split("/")[0]) for name in leaf_names(tree)}):
            release_shared_memory(self.root)
            dataset = build_dataset(self.data_root / "mds", tier, 1, weights={SOURCE: 1.0},
                                    shuffle=False, guard_opt_outs=guarded)
            try:
                seen = [sample["id"] for sample in dataset]
            finally:
                dataset.reader_leases.release()
                del dataset
                release_shared_memory(self.root)
            if len(seen) != len(set(seen)):
                raise self.violation(f"tier {tier}: a sample twice in one epoch")
            if self.opted & set(seen):
                raise self.violation(f"tier {tier}: opted-out {sorted(self.opted & set(seen))} "
                                     f"streamed ({'with' if guarded else 'without'} the "
                                     "loader's guard)")

    def check_no_credentials(self) -> None:
        needles = [value.encode() for value in CANARIES.values()]
        for top in (self.data_root, self.home, self.logs):
            for path in top.rglob("*"):
                if path.is_file() and not path.is_symlink():
                    data = path.read_bytes()
                    found = [n for n in needles if n in data]
                    if found:
                        raise self.violation(f"a credential value in {path}")

    # ------------------------------------------------------------------ reporting
    def note(self, line: str) -> None:
        self.schedule.append(line)
        print(f"   {line}", flush=True)

    def violation(self, invariant: str) -> Violation:
        return Violation(f"seed {self.seed}, cycle {getattr(self, 'number', 0)}: {invariant}\n"
                         "schedule so far:\n   " + "\n   ".join(self.schedule))


def soak(state: Soak, cycles: int) -> Soak:
    """Run `cycles` cycles of the seed's schedule; raises Violation."""
    state.setup()
    state.note("initial source_job, dedup_job, skip_lists_job")
    state.plain_runs()
    for number in range(1, cycles + 1):
        state.cycle(number)
    return state


def summary(state: Soak) -> str:
    seconds = sorted(state.cycle_seconds) or [0.0]
    return (f"seed {state.seed}: {len(state.cycle_seconds)} cycle(s) done, {state.runs} runs "
            f"started, {state.failed_runs} failed, {state.faults} faults injected, "
            f"{state.retries} step retries; cycle median {statistics.median(seconds):.1f} s, "
            f"max {seconds[-1]:.1f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=DEFAULT_CYCLES)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--dir", help="work folder (default: a temporary one, removed after)")
    args = parser.parse_args(argv if argv is not None else [])
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="prx-soak-"))
    started = time.perf_counter()
    state = Soak(root, args.seed)
    try:
        soak(state, args.cycles)
    except Violation as violation:
        print(f"VIOLATION {violation}", file=sys.stderr)
        print(summary(state), flush=True)
        return 1
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    print(summary(state) + ", no violation", flush=True)
    report([Figure("soak", "cycles without violation", args.cycles, "cycles asked",
                   args.cycles, "cycles"),
            Figure("soak", "runs started", state.runs, "cycles x 3", 3 * args.cycles, "runs"),
            Figure("soak", "faults injected (SIGKILL)", state.faults, "cycles", args.cycles,
                   "kills"),
            Figure("soak", "runs failed", state.failed_runs, "runs", state.runs, "runs"),
            Figure("soak", "wall time", round(time.perf_counter() - started), "cycles",
                   args.cycles, "s")], "soak")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
