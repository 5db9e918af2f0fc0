"""`dagster dev` on a temporary instance, for driving the Dagster UI from a browser test.

The instance is the repo's own `dagster.yaml` (queued run coordinator, run monitoring,
pools) with its relative folders made absolute under a temporary DAGSTER_HOME, so runs go
through the same coordinator and daemon as `make ui`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def write_instance(home: Path) -> Path:
    home.mkdir(parents=True, exist_ok=True)
    # The repo's dagster.yaml names no folder: its storage resolves under `home`.
    (home / "dagster.yaml").write_text((REPO / "dagster.yaml").read_text())
    return home


class DagsterDev:
    """`dagster dev` (webserver + daemon) in its own process group, on 127.0.0.1:port."""

    def __init__(self, home: Path, port: int, env: dict[str, str], log: Path):
        self.home, self.port, self.log = write_instance(home), port, log
        self.url = f"http://127.0.0.1:{port}"
        self.env = {**os.environ, **env, "DAGSTER_HOME": str(self.home)}
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> DagsterDev:
        handle = open(self.log, "wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "dagster", "dev", "-w", str(REPO / "workspace.yaml"),
             "-h", "127.0.0.1", "-p", str(self.port)],
            cwd=REPO, env=self.env, stdout=handle, stderr=subprocess.STDOUT,
            start_new_session=True)
        self.wait_until_serving()
        return self

    def wait_until_serving(self, safety_net_s: float = 300) -> None:
        """Until the webserver answers /server_info and the code location has loaded (its
        GraphQL status), or the process dies."""
        process = self.process
        if process is None:
            raise RuntimeError("dagster dev was not started")
        deadline = time.monotonic() + safety_net_s
        query = b'{"query": "{ workspaceOrError { ... on Workspace { locationEntries { ' \
                b'loadStatus } } } }"}'
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"dagster dev exited ({process.returncode}); see "
                                   f"{self.log}:\n{self.log.read_text()[-3000:]}")
            try:
                request = urllib.request.Request(self.url + "/graphql", data=query,
                                                 headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=10) as response:
                    body = response.read().decode()
                if '"LOADED"' in body:
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"dagster dev did not load its code location; see {self.log}")

    def __exit__(self, *exc) -> None:
        """Ctrl-C (what `dagster dev` expects), then the whole process group is killed: the
        instance is temporary, nothing in it needs a clean shutdown."""
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(5)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(30)
