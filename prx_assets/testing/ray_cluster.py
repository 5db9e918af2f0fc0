"""A real two-node Ray cluster on this machine, for tests of the cluster path.

Both nodes are `ray start --block` processes in their own process groups, with token
auth (required for multi-node since Ray 2.60) and a private temp dir, so stopping them
never touches the test session's embedded Ray.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from prx_assets.testing.processes import wait_for_group_gone

RAY = str(Path(sys.executable).parent / "ray")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class TwoNodeCluster:
    def __init__(self, cpus_per_node: int = 1,
                 node_envs: tuple[dict, dict] | None = None):
        """`node_envs`: extra variables for the head and the worker node (each its own
        TMPDIR, say, so the nodes share no work folder)."""
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.temp_dir = tempfile.mkdtemp(prefix="prxray-", dir="/tmp")  # short: unix sockets
        # RAY_TMPDIR: Ray's sockets stay under the short temp dir whatever TMPDIR a node has.
        self.env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_TMPDIR": self.temp_dir,
                    "RAY_AUTH_TOKEN": secrets.token_hex(32), "RAY_USAGE_STATS_ENABLED": "0"}
        self.env.pop("RAY_ADDRESS", None)
        self.cpus = cpus_per_node
        self.processes: list[subprocess.Popen] = []
        self.starts: list[tuple[list[str], str]] = []
        self.node_envs: dict[str, dict] = {"head.log": {}, "worker.log": {}}
        if node_envs:
            self.node_envs = {"head.log": dict(node_envs[0]), "worker.log": dict(node_envs[1])}

    def _start(self, args: list[str], log_name: str) -> None:
        self.starts.append((args, log_name))
        self.processes.append(self._spawn(args, log_name))

    def _spawn(self, args: list[str], log_name: str) -> subprocess.Popen:
        # The child gets its own copy of the descriptor: this one can close once it started.
        with open(Path(self.temp_dir) / log_name, "a") as log:
            return subprocess.Popen(
                [RAY, "start", "--block", "--node-ip-address=127.0.0.1",
                 f"--num-cpus={self.cpus}", "--disable-usage-stats", *args],
                env={**self.env, **self.node_envs.get(log_name, {})}, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True)

    def _restart_exited(self) -> None:
        """A node whose `ray start` gave up (its raylet can time out on a loaded machine) is
        started again; a real cluster's node supervisor would do the same."""
        for i, process in enumerate(self.processes):
            if process.poll() is not None:
                # whatever it left behind in its process group
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                self.processes[i] = self._spawn(*self.starts[i])

    def __enter__(self) -> TwoNodeCluster:
        self._start(["--head", f"--port={self.port}", "--include-dashboard=false",
                     f"--temp-dir={self.temp_dir}"], "head.log")
        self._wait_for_nodes(1)
        self._start([f"--address={self.address}"], "worker.log")
        self._wait_for_nodes(2)
        return self

    def driver_env(self) -> dict:
        return {**self.env, "RAY_ADDRESS": self.address}

    def _wait_for_nodes(self, count: int, timeout: float = 300) -> None:
        probe = (f"import ray; ray.init(address='{self.address}', _node_ip_address='127.0.0.1', "
                 "logging_level='ERROR'); print(sum(n['Alive'] for n in ray.nodes()))")
        deadline = time.time() + timeout
        while time.time() < deadline:
            out = subprocess.run([sys.executable, "-c", probe], env=self.env, capture_output=True,
                                 text=True, timeout=120)
            if out.returncode == 0 and out.stdout.strip().splitlines()[-1:] == [str(count)]:
                return
            self._restart_exited()
            time.sleep(1)
        logs = "\n".join(p.read_text()[-2000:] for p in Path(self.temp_dir).glob("*.log"))
        raise RuntimeError(f"Ray cluster did not reach {count} node(s):\n{logs}")

    def __exit__(self, *exc) -> None:
        """SIGKILL each node's process group: nothing of a test cluster is kept, and a node
        given SIGTERM took its full 30 s grace to stop."""
        for process in reversed(self.processes):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
            wait_for_group_gone(process.pid)
