"""A seeded fault soak: a random schedule of source changes, hostile files, opt-outs, runs,
kills, a captioner change and a reader, with an invariant checker after every cycle.

    python -m bench.soak --cycles N --seed S [--s3] [--dir DIR] [--sources web,tars,pq]
        [--kinds plain:8,captioner:1,...] [--no-asset-checks]

Three sources (or those `--sources` names) on local disk (`bench/soak_sources.py`: a folder
of JPEGs with caption files, a folder of WebDataset tars, a folder of Parquet files), a
Dagster instance of its own and one Ray for the whole soak. Plain runs execute in this
process, as `dagster.materialize` in a script does (real runs of the instance, on the
shared Ray); a run that is killed or runs beside another is a process of its own
(`testing.fault_runs`) joining that Ray. Each cycle, drawn from the seed:

- one or two sources change: files added, removed, replaced, swapped (same name, other
  bytes); the folder also gets hostile files (empty, truncated, not an image, a PNG header
  claiming 2³¹ pixels a side) added or removed;
- an opt-out of a published sample through the CLI (`prx-assets opt-out`) or a request
  file dropped in the opt-out folder (`source_key` of the sample);
- a trainer streaming one tier of a source's tree (its loader's reader lease holding it)
  epoch after epoch in a thread, throughout the runs;
- one of: nothing more; two source_job runs of one partition at once; source_job runs of
  two partitions at once; a source_job SIGKILLed at a random failpoint; a source_job
  SIGKILLed at a random time; a captioner version change (an OpenAI-compatible local
  server answering one caption per version: every sample is captioned again);
- then, as the sensors would start them: source_job of each changed source, dedup_job,
  skip_lists_job of each source touched (changed or opted out).

The invariants, after every cycle (`check`), for every source: the published tree is whole
(every indexed shard present with its size, the mapping naming only versions the tree
holds); the trainer never errored, saw no sample twice in an epoch and the same samples
every epoch, and its leased tree is whole after the runs; no table holds a key twice; the
tree holds exactly the model's samples (every image the source holds now, by id, none
else) and, streamed by a fresh loader of every tier, exactly those minus the opted-out and
those whose active caption the labels stage's classifier labels `text` or `nsfw`,
each with the caption of the active captioner, none twice in an epoch, with and without
the loader's own opt-out guard (the sidecars alone); the tree versions on disk take at
most 1.2x the live ones (current and leased; retention is 0 days in the soak); no
credential value set in the soak's environment appears in any file under the data root,
the Dagster instance or the run logs, nor in the environment of any Ray worker.

`--s3`: the data root (tables, trees, opt-out folder, leases) in a bucket of the S3 test
server the tests use (`testing.s3_server`: SeaweedFS on 127.0.0.1, started under the work
folder; or the one `AWS_ENDPOINT_URL` names when that is a loopback address, with the
credentials of the environment), the standard AWS variables pointing at it as the `s3`
tests set them. The sources, the Dagster instance and the logs stay on local disk (as in
the S3 graph test's runs, the sources are read where they are). Every invariant reads
through the storage layer: the same checks on object listings and objects (the disk check
counts every object: S3 has no hard links, a carried shard is a copy), the loaders stream
into a cache under the work folder, and the credentials scanned for are the server's
access key and secret (which must not be canaries there) beside the OpenAI canary.

A violation prints the seed, the cycle, the schedule so far and the invariant, and the run
exits 1. Everything random comes from `--seed`: the same seed replays the same schedule
(the machine's timing aside: which step a random-time kill lands in). `main()`
(bench/run_all.py) runs a short soak.
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
from bench.soak_checks import check_cycle
from bench.soak_doors import CURATOR_TOKEN, browser_request, drop_request, s3_data_root
from bench.soak_probes import Trainer, failure_cause, step_retries
from bench.soak_sources import SOURCE_CLASSES, make_sources

FAILPOINTS = ("ingest.expand_units", "ingest.chunk_committed", "images.chunk_committed",
              "captions.chunk_committed", "mds.before_mapping_commit", "mds.before_publish")
CANARIES = {"OPENAI_API_KEY": "sk-soak-canary-openai-0123456789",
            "AWS_SECRET_ACCESS_KEY": "soak-canary-aws-secret-0123456789"}
# On S3 the AWS variables are the server's real credentials: scanned for instead of canaries.
S3_CREDENTIALS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
# Superseded trees go at the next publish (unless a reader holds them): the disk check.
SOURCE_RUN_CONFIG = {"ops": {"mds_shards": {"config": {"retention_days": 0}}}}
RUN_TIMEOUT_S = 900
RANDOM_KILL_S = (1.0, 30.0)  # a random-time kill lands this long after the run started
# Draw weights: mostly plain cycles (runs in this process); the others start processes.
KINDS = {"plain": 8, "twice": 2, "partitions": 2, "kill": 3, "kill_random": 2,
         "captioner": 1}
CAPTIONER_CAPTIONS = ("A photograph of a red kite over a green hill, captioner version {}.",
                      "A soak caption of captioner version {}.")
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
    captioner_version: int = 0  # 0: the sources' own captions
    kinds: dict[str, int] = field(default_factory=lambda: dict(KINDS))  # draw weights
    source_names: tuple[str, ...] = tuple(SOURCE_CLASSES)
    # The runs' asset checks (Dagster's, not the soak's invariants): off, a plain cycle of
    # one source takes about half the time (the leaves_stream check starts a process).
    asset_checks: bool = True
    number: int = 0
    # An `s3://` data root (the AWS variables of the environment reach it): `--s3`.
    s3_root: str | None = None

    def __post_init__(self) -> None:
        from prx_assets.storage.layout import Storage

        self.rng = random.Random(self.seed)
        self.data_root = self.root / "data"  # local mode's data root
        self.storage = Storage(self.s3_root or str(self.data_root))
        # Where loaders stream a bucket's shards to (None: local trees are read in place).
        self.cache_dir = self.root / "cache" if self.s3_root else None
        self.home = self.root / "home"
        self.logs = self.root / "logs"
        self.captioner_file: Path | None = None
        self.leased: dict[str, set[str]] = {}  # source -> tree versions a reader leased
        self.servers: list = []
        self.labels: dict[str, str] = {}  # caption -> the embedded classifier's label

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        from prx_assets.testing.fault_runs import write_instance_config
        from prx_assets.testing.sources import write_sources

        self.logs.mkdir(parents=True, exist_ok=True)
        self.storage.location().make_dirs()
        write_instance_config(self.home)
        self.sources = make_sources(self.root, self.rng, self.source_names)
        self.by_name = {s.name: s for s in self.sources}
        self.sources_file = write_sources(self.root / "sources.yaml",
                                          [s.entry() for s in self.sources])
        canaries = {name: value for name, value in CANARIES.items()
                    if not (self.s3_root and name in S3_CREDENTIALS)}
        os.environ.update(PRX_DATA_ROOT=self.storage.root, PRX_SOURCES=str(self.sources_file),
                          DAGSTER_HOME=str(self.home), **canaries)
        self.storage.check_reachable()
        self.start_factory()

    def secrets(self) -> list[str]:
        """The credential values no table, log, metadata value or Ray worker may hold: the
        browser door's curator token, the canaries, and on S3 the server's credentials in
        their place."""
        found = [CURATOR_TOKEN] + [value for name, value in CANARIES.items()
                                   if not (self.s3_root and name in S3_CREDENTIALS)]
        if self.s3_root:
            found += [os.environ[name] for name in S3_CREDENTIALS if os.environ.get(name)]
        return found

    def start_factory(self) -> None:
        """One Ray for the whole soak (embedded, the credentials withheld from it), the code
        location's definitions and the instance, loaded once: the plain runs execute in this
        process, each a real run of the instance on the shared Ray (its workers warm from
        run to run, as on a cluster); the runs that are killed or run beside another are
        processes of their own that join this Ray."""
        import ray

        from prx_assets.engine import ray_runtime
        from prx_assets.testing.fault_runs import open_instance

        ray_runtime.connect()
        self.ray_address = ray.get_runtime_context().gcs_address
        self.load_defs()
        self.instance = open_instance(self.home)

    def load_defs(self) -> None:
        from prx_assets.definitions import build_defs

        self.defs = build_defs(self.sources_file, self.captioner_file)

    # ------------------------------------------------------------------ source changes
    def change_sources(self) -> set[str]:
        changed = self.rng.sample(self.sources,
                                  min(self.rng.choice([1, 1, 1, 2]), len(self.sources)))
        for source in changed:
            for _ in range(self.rng.randint(1, 2)):
                self.note(f"{source.name}: {source.change()}")
        return {s.name for s in changed}

    # ------------------------------------------------------------------ opt-outs
    def opt_out(self) -> str | None:
        """An opt-out of a published sample, through the CLI, a dropped file or the
        browser; returns the source it is in."""
        from prx_assets.storage.tables import MDS_SAMPLES

        source = self.rng.choice(self.sources)
        mapping = self.storage.table(MDS_SAMPLES, source.name)
        if not mapping.exists():
            return None
        ids = sorted(set(mapping.to_table(columns=["id"])["id"].to_pylist()) - self.opted)
        if not ids:
            return None
        chosen = self.rng.choice(ids)
        door_draw = self.rng.random()
        if door_draw < 0.5:
            with contextlib.redirect_stdout(io.StringIO()):
                status = cli_main(["opt-out", chosen, "--reason", f"soak {self.seed}"])
            if status != 0:
                raise self.violation("the CLI refused an opt-out of a published sample")
            door = "cli"
        elif door_draw < 0.75:
            door = drop_request(self, source, chosen)
        else:
            door = browser_request(self, chosen)
        self.opted.add(chosen)
        self.note(f"opt-out {chosen} ({door})")
        return source.name

    # ------------------------------------------------------------------ captioner
    def change_captioner(self) -> None:
        """A new captioner version: a local OpenAI-compatible server answering one caption,
        named by the version; every sample is captioned again and its trees rebuilt."""
        from prx_assets.testing.fault_runs import CaptionServer

        self.captioner_version += 1
        server = CaptionServer(self.model_caption())
        self.servers.append(server)
        self.captioner_file = self.root / "captioner.yaml"
        self.captioner_file.write_text(
            f"backend: openai\nmodel: soak-captioner-v{self.captioner_version}\n"
            f"endpoint: {server.url}\n")
        self.load_defs()
        self.note(f"captioner version {self.captioner_version} (soak-captioner)")

    def model_caption(self) -> str:
        """Odd versions: a caption the labels stage calls `text` (every sample skipped, as
        skip_lists does by default); even ones: a `visual` caption, streamed."""
        return CAPTIONER_CAPTIONS[self.captioner_version % 2].format(self.captioner_version)

    # ------------------------------------------------------------------ runs
    def run_here(self, job: str, partition: str | None) -> bool:
        """One run of `job` in this process, tagged as a sensor's run is."""
        from prx_assets.testing.fault_runs import job_subset

        self.runs += 1
        result = job_subset(self.defs, job, [], self.asset_checks).execute_in_process(
            partition_key=partition, instance=self.instance, raise_on_error=False,
            run_config=SOURCE_RUN_CONFIG if job == "source_job" else None,
            tags={"prx/trigger": "soak", "prx/trigger_reason": f"seed {self.seed}"})
        self.count_retries(result.run_id)
        if not result.success:
            self.failed_runs += 1
        return result.success

    def start(self, job: str, partition: str | None, failpoint: str | None = None):
        from prx_assets.testing.fault_runs import RunProcess, RunSpec

        spec = RunSpec(self.sources_file, job, partition, self.home, self.storage.root,
                       assets=() if self.asset_checks else self.job_assets(job),
                       captioner=self.captioner_file, ray_address=self.ray_address,
                       run_config=SOURCE_RUN_CONFIG if job == "source_job" else None)
        if failpoint:
            spec.arm(failpoint, self.logs)
        self.runs += 1
        return RunProcess(spec, self.logs)

    def job_assets(self, job: str) -> tuple[str, ...]:
        """The job's assets by name (a run of them all is the job less its checks)."""
        keys = self.defs.resolve_job_def(job).asset_layer.selected_asset_keys
        return tuple(sorted(key.to_user_string() for key in keys))

    def finish(self, run) -> bool:
        result = run.wait(RUN_TIMEOUT_S)
        self.count_retries(run.spec.run_id)
        if not result["success"]:
            self.failed_runs += 1
            cause = failure_cause(self.instance, run.spec.run_id) or "no step failed"
            self.note(f"  {run.spec.job}[{run.spec.partition}] failed: {cause} "
                      f"(log {run.log.name})")
        return bool(result["success"])

    def count_retries(self, run_id: str) -> None:
        retries = step_retries(self.instance, run_id)
        if retries:
            self.retries += retries
            self.note(f"  {retries} step retr{'y' if retries == 1 else 'ies'} in run {run_id[:8]}")

    def killed(self, run, how: str) -> None:
        from prx_assets.testing.fault_runs import mark_killed_run_failed

        run.kill()
        self.faults += 1
        mark_killed_run_failed(self.instance, run.spec.run_id)
        self.note(f"source_job[{run.spec.partition}] SIGKILLed {how}")

    def kill_at_failpoint(self, source: str) -> None:
        from prx_assets.testing.fault_runs import wait_for_failpoint

        point = self.rng.choice(FAILPOINTS)
        run = self.start("source_job", source, point)
        try:
            wait_for_failpoint(run)
        except AssertionError:  # the run passed nowhere near it (nothing to do there)
            self.note(f"source_job[{source}] armed at {point}: ended without reaching it")
            self.finish(run)
            return
        self.killed(run, f"at {point}")

    def kill_at_random(self, source: str) -> None:
        delay = round(self.rng.uniform(*RANDOM_KILL_S), 1)
        run = self.start("source_job", source)
        try:
            run.process.wait(timeout=delay)
        except Exception:  # still running: the kill lands wherever it is
            self.killed(run, f"{delay} s after its start")
            return
        self.note(f"source_job[{source}] ended before its kill at {delay} s")
        self.finish(run)

    def at_once(self, partitions: list[str]) -> None:
        runs = [self.start("source_job", p) for p in partitions]
        done = [self.finish(run) for run in runs]
        self.note(f"source_job runs at once {partitions}: {done}")
        if len(set(partitions)) == 1 and not any(done):
            raise self.violation("two runs of one partition: neither succeeded")
        for run, ok in zip(runs, done, strict=True):  # a loser may only have waited too long
            cause = "" if ok else failure_cause(self.instance, run.spec.run_id)
            if cause and "LeaseHeldError" not in cause:
                raise self.violation(f"a run beside another failed: {cause}")
        if len(set(partitions)) > 1 and not all(done):
            raise self.violation("runs of different partitions at once: one failed")

    def plain_runs(self, changed: set[str], touched: set[str]) -> None:
        """What the sensors start: each changed source's source_job, then the duplicates
        and opt-out audit, then each touched source's skip lists."""
        plan = [("source_job", s) for s in sorted(changed)] + [("dedup_job", None)] + \
            [("skip_lists_job", s) for s in sorted(touched)]
        for job, partition in plan:
            if not self.run_here(job, partition):
                raise self.violation(f"{job}[{partition}] failed on a plain run (its events in "
                                     f"the instance at {self.home})")
        self.note(", ".join(f"{job}[{p}]" if p else job for job, p in plan))

    # ------------------------------------------------------------------ one cycle
    def cycle(self, number: int) -> None:
        self.number = number
        started = time.perf_counter()
        self.note(f"-- cycle {number}")
        changed = self.change_sources()
        touched = set(changed)
        if self.rng.random() < 0.5:
            opted_in = self.opt_out()
            if opted_in:
                touched.add(opted_in)
        trainer = self.start_trainer()
        kind = self.rng.choices(list(self.kinds), weights=list(self.kinds.values()))[0]
        one = self.rng.choice(sorted(changed))
        if kind == "twice":
            self.at_once([one, one])
        elif kind == "partitions":
            self.at_once(sorted(self.rng.sample(sorted(self.by_name), 2)))
        elif kind == "kill":
            self.kill_at_failpoint(one)
        elif kind == "kill_random":
            self.kill_at_random(one)
        elif kind == "captioner":
            self.change_captioner()
            changed = touched = set(self.by_name)
        self.plain_runs(changed, touched)
        check_cycle(self, trainer)
        self.cycle_seconds.append(time.perf_counter() - started)
        self.note(f"cycle {number}: {self.cycle_seconds[-1]:.1f} s")

    def start_trainer(self) -> Trainer | None:
        """A trainer streaming one tier of one source's current tree, epoch after epoch,
        throughout the cycle's runs (its loader's reader lease holding the tree)."""
        from prx_assets.storage.trees import leaf_names, source_trees

        source = self.rng.choice(self.sources).name
        store = source_trees(self.storage.mds_root, source)
        if store.current_version() is None:
            return None
        tree = store.current_tree()  # no run is going: the tree the loader leases
        tier = self.rng.choice(sorted({int(name.split("/")[0]) for name in leaf_names(tree)}))
        trainer = Trainer(self.storage.mds_root, source, tier, tree, self.cache_dir)
        self.note(f"trainer streaming {source} tier {tier} of tree {tree.name} (reader lease)")
        return trainer

    # ------------------------------------------------------------------ reporting
    def note(self, line: str) -> None:
        self.schedule.append(line)
        print(f"   {line}", flush=True)

    def violation(self, invariant: str) -> Violation:
        return Violation(f"seed {self.seed}, cycle {self.number}: {invariant}\n"
                         "schedule so far:\n   " + "\n   ".join(self.schedule))


def kind_weight(item: str) -> tuple[str, int]:
    """`kind` or `kind:weight` (0: the kind's default weight)."""
    kind, _, weight = item.partition(":")
    return kind, int(weight or 0)


def cli_main(argv: list[str]) -> int:
    from prx_assets import cli

    return cli.main(argv)


def soak(state: Soak, cycles: int) -> Soak:
    """Run `cycles` cycles of the seed's schedule; raises Violation."""
    state.setup()
    everything = {s.name for s in state.sources}
    state.note("initial runs")
    state.plain_runs(everything, everything)
    for number in range(1, cycles + 1):
        state.cycle(number)
    return state


def run_soak(state: Soak, cycles: int) -> int:
    """`soak` with its outcome printed: 0, 1 on a violation, 130 when stopped by hand;
    the caption servers closed after."""
    try:
        soak(state, cycles)
    except Violation as violation:
        print(f"VIOLATION {violation}", file=sys.stderr, flush=True)
        print(summary(state), flush=True)
        return 1
    except KeyboardInterrupt:  # a long soak stopped by hand: its figures so far
        print(summary(state) + ", interrupted", flush=True)
        return 130
    finally:
        for server in state.servers:
            server.close()
    return 0


def summary(state: Soak) -> str:
    seconds = sorted(state.cycle_seconds) or [0.0]
    return (f"seed {state.seed}: {len(state.cycle_seconds)} cycle(s) done, {state.runs} runs "
            f"started, {state.failed_runs} failed, {state.faults} faults injected (SIGKILL), "
            f"{state.retries} step retries; cycle median {statistics.median(seconds):.1f} s, "
            f"max {seconds[-1]:.1f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=DEFAULT_CYCLES)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--dir", help="work folder (default: a temporary one, removed after)")
    parser.add_argument("--s3", action="store_true",
                        help="the data root in a bucket of the S3 test server (SeaweedFS on "
                             "127.0.0.1: started in the work folder, or the one a loopback "
                             "AWS_ENDPOINT_URL names); sources and instance stay local")
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help=f"the cycle kinds drawn from, `kind` or `kind:weight` (default "
                             f"all: {','.join(f'{k}:{w}' for k, w in KINDS.items())}); another "
                             "list is another schedule")
    parser.add_argument("--no-asset-checks", action="store_true",
                        help="runs without their asset checks (the soak's invariants are "
                             "checked all the same): cycles about twice as fast")
    parser.add_argument("--sources", default=",".join(SOURCE_CLASSES),
                        help=f"the sources (default all: {','.join(SOURCE_CLASSES)}); another "
                             "list is another schedule")
    args = parser.parse_args(argv if argv is not None else [])
    try:
        weights = dict(kind_weight(item) for item in args.kinds.split(","))
    except ValueError:
        parser.error(f"--kinds {args.kinds}: each `kind` or `kind:weight` (a whole number)")
    kinds, names = list(weights), args.sources.split(",")
    for what, asked, known in (("cycle kinds", kinds, KINDS), ("sources", names, SOURCE_CLASSES)):
        if set(asked) - set(known):
            parser.error(f"unknown {what} {sorted(set(asked) - set(known))}; known: "
                         f"{', '.join(known)}")
    if len(set(names)) < 2 and "partitions" in kinds:
        if args.kinds != parser.get_default("kinds"):
            parser.error("the cycle kind `partitions` needs two sources")
        kinds.remove("partitions")
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="prx-soak-"))
    started = time.perf_counter()
    try:
        with contextlib.ExitStack() as stack:
            s3_root = stack.enter_context(s3_data_root(root, args.seed)) if args.s3 else None
            state = Soak(root, args.seed, kinds={k: weights[k] or KINDS[k] for k in kinds},
                         source_names=tuple(names), asset_checks=not args.no_asset_checks,
                         s3_root=s3_root)
            status = run_soak(state, args.cycles)
    finally:
        if not args.dir:  # after the S3 server under it stopped
            shutil.rmtree(root, ignore_errors=True)
    if status:
        return status
    print(summary(state) + ", no violation", flush=True)
    report([Figure("soak", "cycles without violation", args.cycles, "cycles asked",
                   args.cycles, "cycles"),
            Figure("soak", "runs started", state.runs, "cycles", args.cycles, "runs"),
            Figure("soak", "faults injected (SIGKILL)", state.faults, "cycles", args.cycles,
                   "kills"),
            Figure("soak", "step retries", state.retries, "runs", state.runs, "retries"),
            Figure("soak", "runs failed", state.failed_runs, "runs", state.runs, "runs"),
            Figure("soak", "median cycle", round(statistics.median(state.cycle_seconds or [0]),
                                                 1), "cycles", args.cycles, "s"),
            Figure("soak", "wall time", round(time.perf_counter() - started), "cycles",
                   args.cycles, "s")], "soak-s3" if args.s3 else "soak")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
