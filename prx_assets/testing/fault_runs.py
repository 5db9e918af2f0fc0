"""Helpers for the fault tests: Dagster runs in killable subprocesses on a shared on-disk
instance, armed with a failpoint, and snapshots of every stored table and shard tree.

A run is `python -m prx_assets.testing.fault_runs ...` started in its own session
(process group), so `os.killpg(SIGKILL)` takes its embedded Ray (raylet, GCS, workers) down
with it, as a crashed machine or an OOM kill of the run would. A run armed with a failpoint
(`prx_assets.storage.failpoints`) holds at that point, in its own process or in the Ray
worker that reached it, until killed: the test waits for the marker file, so the kill lands
at the same place however loaded the machine is.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import lance

from prx_assets.storage import failpoints
from prx_assets.testing.processes import wait_for_group_gone

PER_SOURCE_TABLES = ("raw_images", "bucketed_images", "phashes", "captions", "caption_labels",
                     "mds_samples")
GLOBAL_TABLES = ("duplicates",)


def write_instance_config(home: Path) -> Path:
    """A DAGSTER_HOME like the repo's dagster.yaml (SQLite storage, pools of 1), with
    absolute paths, so every process opening it shares one instance."""
    home.mkdir(parents=True, exist_ok=True)
    (home / "dagster.yaml").write_text(
        f"storage:\n  sqlite:\n    base_dir: {home / 'storage'}\n"
        f"local_artifact_storage:\n  module: dagster._core.storage.root\n"
        f"  class: LocalArtifactStorage\n  config:\n    base_dir: {home}\n"
        "concurrency:\n  pools:\n    default_limit: 1\n    granularity: op\n"
        "telemetry:\n  enabled: false\n")
    return home


def open_instance(home: Path):
    import dagster as dg
    from dagster._core.instance.ref import InstanceRef

    return dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(home)))


# ------------------------------------------------------------------------------ subprocess runs

@dataclass
class RunSpec:
    sources: Path
    job: str
    partition: str | None
    home: Path
    data_root: Path | str  # a local folder or an s3:// root
    assets: tuple[str, ...] = ()
    captioner: Path | None = None
    run_config: dict | None = None
    run_id: str = ""
    failpoint: str | None = None  # armed in the run (and its Ray workers)
    marker: Path | None = None  # where the failpoint's holder writes its marker
    # A running Ray to join (RAY_ADDRESS) instead of an embedded one per run: a cluster's
    # way, and seconds less per run. A run killed there takes its job's Ray workers with it
    # (Ray ends a dead driver's tasks); `RunProcess.kill` also kills a failpoint's holder.
    ray_address: str | None = None

    def arm(self, failpoint: str, marker_dir: Path) -> RunSpec:
        """Arm `failpoint` with a marker file of its own for this run id."""
        self.failpoint = failpoint
        self.marker = marker_dir / f"failpoint-{self.run_id[:8]}-{failpoint}.json"
        return self

    def __post_init__(self) -> None:
        self.run_id = self.run_id or str(uuid.uuid4())


class RunProcess:
    """One Dagster run in its own process group; stdout/stderr to a log file."""

    def __init__(self, spec: RunSpec, log_dir: Path):
        self.spec = spec
        self.log = log_dir / f"run-{spec.job}-{spec.partition}-{spec.run_id[:8]}.log"
        args = [sys.executable, "-m", "prx_assets.testing.fault_runs",
                "--sources", str(spec.sources), "--job", spec.job, "--run-id", spec.run_id,
                "--partition", spec.partition or "", "--assets", ",".join(spec.assets),
                "--captioner", str(spec.captioner or ""),
                "--run-config", json.dumps(spec.run_config or {})]
        env = {**os.environ, "DAGSTER_HOME": str(spec.home), "PRX_DATA_ROOT": str(spec.data_root),
               "RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1"}
        env.pop("RAY_ADDRESS", None)  # an embedded Ray per run, as `dagster dev` runs it
        if spec.ray_address:
            env["RAY_ADDRESS"] = spec.ray_address
        for name in (failpoints.ENV_POINTS, failpoints.ENV_MARKER):
            env.pop(name, None)
        if spec.failpoint:
            assert spec.marker is not None, "a failpoint is armed with its marker (RunSpec.arm)"
            env.update(failpoints.env(spec.failpoint, spec.marker))
            # A run that is killed: its leases expire seconds after, not two minutes. Not
            # less: the run checks its lease at commits before its failpoint, and on a loaded
            # machine a heartbeat can be late by a second or two.
            env["PRX_LEASE_TTL_S"] = "10"
        with open(self.log, "w") as out:
            self.process = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT,
                                            start_new_session=True,
                                            cwd=Path(__file__).resolve().parents[2])

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL the whole process group: the run, its Ray driver, raylet and workers; and
        the process holding the run's failpoint, which is a worker of a joined Ray outside
        the group (an embedded one's worker is in it)."""
        holder = failpoints.read_marker(self.spec.marker) if self.spec.marker else None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        if holder:
            with contextlib.suppress(ProcessLookupError):
                os.kill(holder["pid"], signal.SIGKILL)
        self.process.wait(timeout=60)
        wait_for_group_gone(self.process.pid)

    def wait(self, timeout: float = 300) -> dict:
        try:
            self.process.wait(timeout=timeout)
        finally:
            if self.alive():
                self.kill()
        return self.result()

    def result(self) -> dict:
        lines = [line for line in self.output().splitlines() if line.startswith("RESULT ")]
        if not lines:
            raise AssertionError(f"run {self.spec.run_id} printed no result:\n"
                                 f"{self.output()[-6000:]}")
        return json.loads(lines[-1][len("RESULT "):])

    def output(self) -> str:
        return self.log.read_text(errors="replace")




def wait_until(condition: Callable[[], object], what: str, run: RunProcess | None = None,
               timeout: float = 180, interval: float = 0.02):
    """Poll `condition` until it returns something truthy; fail if the run ends first."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = condition()
        if found:
            return found
        if run is not None and not run.alive():
            raise AssertionError(f"the run ended before {what}:\n{run.output()[-6000:]}")
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}"
                         + (f":\n{run.output()[-6000:]}" if run else ""))


def wait_for_failpoint(run: RunProcess) -> dict:
    """The marker of the run's armed failpoint, once a process of the run holds there.
    The run cannot finish without passing the point, so this is no race; the timeout of
    `wait_until` is only a safety net for a run that never gets there."""
    marker = run.spec.marker
    assert run.spec.failpoint and marker, "the run is not armed"
    return wait_until(lambda: failpoints.read_marker(marker),
                      f"failpoint {run.spec.failpoint}", run, timeout=600)


def process_title(pid: int) -> str:
    """A process's command line; a Ray worker's reads `ray::<task or operator>`."""
    import psutil

    return " ".join(psutil.Process(pid).cmdline())


def mark_killed_run_failed(instance, run_id: str) -> None:
    """What an operator (force-terminate in the UI) and the daemon do for a run whose process
    died: mark it failed, then free the concurrency-pool slots it held (the `gpu` pool),
    as the daemon does `free_slots_after_run_end_seconds` later (dagster.yaml)."""
    run = instance.get_run_by_id(run_id)
    if run is not None and not run.is_finished:
        instance.report_run_failed(run, "run process killed (SIGKILL) by the fault test")
    instance.event_log_storage.free_concurrency_slots_for_run(run_id)


def step_started(instance, run_id: str, step: str) -> bool:
    from dagster import DagsterEventType

    records = instance.get_records_for_run(run_id, of_type=DagsterEventType.STEP_START).records
    return any(r.event_log_entry.step_key == step for r in records)


def materialized_in_run(instance, run_id: str) -> set[str]:
    from dagster import DagsterEventType

    records = instance.get_records_for_run(
        run_id, of_type=DagsterEventType.ASSET_MATERIALIZATION).records
    return {r.event_log_entry.asset_materialization.asset_key.path[-1] for r in records}


# ------------------------------------------------------------------------------ snapshots

def table_state(uri: Path, version: int | None = None) -> dict:
    """Version, and every row (image bytes as digests) sorted, of a Lance table version."""
    table = lance.dataset(str(uri), version=version)
    rows = table.to_table().to_pylist()
    for row in rows:
        for key, value in row.items():
            if isinstance(value, bytes):
                row[key] = hashlib.sha256(value).hexdigest()
            elif not isinstance(value, (str, int, float, bool, type(None))):
                row[key] = str(value)
    rows.sort(key=lambda r: json.dumps(r, sort_keys=True))
    return {"version": table.version, "rows": rows}


def tree_state(data_root: Path, source: str, stream: bool = False) -> dict:
    """The current MDS tree of a source as a reader sees it: every leaf opened with
    mosaicml-streaming's index (index.json), each shard's bytes digested, each skip
    sidecar parsed, and the samples a StreamingDataset counts per leaf."""
    from prx_assets.stages.shards.verify import streamed_counts
    from prx_assets.storage.sidecars import read_sidecar, sidecar_path
    from prx_assets.storage.trees import current_tree, tree_leaves

    tree = current_tree(data_root, source)
    leaves = {}
    for leaf in tree_leaves(tree):
        index = json.loads((leaf / "index.json").read_text())
        shards = {}
        for entry in index["shards"]:
            name = entry["raw_data"]["basename"]
            data = (leaf / name).read_bytes()
            assert len(data) == entry["raw_data"]["bytes"], f"{leaf / name}: truncated"
            shards[name] = {"sha256": hashlib.sha256(data).hexdigest(),
                            "samples": entry["samples"],
                            "skip": read_sidecar(sidecar_path(leaf / name))}
        leaves[str(leaf.relative_to(tree))] = shards
    state = {"tree": tree.name, "leaves": leaves}
    if stream:  # a process importing streaming: seconds, so only where asked
        names = sorted(leaves)
        counts = streamed_counts([str(tree / name) for name in names]) if names else []
        state["streamed"] = dict(zip(names, counts, strict=True))
    return state


def store_state(data_root: Path, sources: list[str], versions: dict | None = None,
                stream: bool = False) -> dict:
    """Every table (latest version, or the version given per name) and every tree."""
    state = {}
    for source in sources:
        for name in PER_SOURCE_TABLES:
            uri = data_root / "lance" / name / f"{source}.lance"
            if uri.exists():
                key = f"{name}/{source}"
                state[key] = table_state(uri, (versions or {}).get(key))
        if os.path.lexists(data_root / "mds" / source):
            state[f"mds/{source}"] = tree_state(data_root, source, stream)
    for name in GLOBAL_TABLES:
        uri = data_root / "lance" / f"{name}.lance"
        if uri.exists():
            state[name] = table_state(uri, (versions or {}).get(name))
    return state


# ------------------------------------------------------------------------------ the run itself

def job_subset(defs, job: str, assets: list[str], checks: bool = True):
    """The job, or only the named assets of it (all of them with `checks=False`) without
    their checks (checks cost a Ray shuffle or a process each and are tested elsewhere)."""
    import dagster as dg

    job_def = defs.resolve_job_def(job)
    if not assets and checks:
        return job_def
    keys = {dg.AssetKey(a) for a in assets} or set(job_def.asset_layer.selected_asset_keys)
    return job_def.get_subset(asset_selection=keys, asset_check_selection=set())


def run_in_process(defs, job: str, partition: str | None, instance, assets=(),
                   run_config: dict | None = None):
    return job_subset(defs, job, list(assets)).execute_in_process(
        partition_key=partition, instance=instance, raise_on_error=False,
        run_config=run_config)


class CaptionServer:
    """A local OpenAI-compatible endpoint answering every image with a fixed caption after
    `delay_s`."""

    def __init__(self, caption: str = "A test pattern of coloured shapes on a plain ground.",
                 delay_s: float = 0.0):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        answer = json.dumps({"choices": [{"message": {"content": caption}}]}).encode()

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                time.sleep(delay_s)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("sources", "job", "run-id", "partition", "assets", "captioner", "run-config"):
        parser.add_argument(f"--{name}", default="")
    args = parser.parse_args()
    import dagster as dg

    from prx_assets.definitions import build_defs

    defs = build_defs(Path(args.sources), Path(args.captioner) if args.captioner else None)
    job = job_subset(defs, args.job, [a for a in args.assets.split(",") if a])
    print(f"STARTING {args.run_id}", flush=True)
    result = job.execute_in_process(
        partition_key=args.partition or None, instance=dg.DagsterInstance.get(),
        run_id=args.run_id, raise_on_error=False,
        run_config=json.loads(args.run_config or "{}") or None)
    print("RESULT " + json.dumps({"success": result.success, "run_id": result.run_id}),
          flush=True)


if __name__ == "__main__":
    _main()
