"""A writer for the race and kill tests: `python -m <module> ARGS...` in a session of its
own (so a SIGKILL of its group takes its Ray down too), armed through its environment with
failpoints or barriers (`storage.failpoints`), printing `RESULT{json}` when it finishes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class WriterProcess:
    """One writer process of `module`; its output in `log`."""

    module: str

    def __init__(self, args: list[str], env: dict[str, str], log: Path):
        self.log = log
        environment = {**os.environ, **env, "RAY_USAGE_STATS_ENABLED": "0",
                       "PYTHONPATH": str(REPO)}
        environment.pop("RAY_ADDRESS", None)
        with open(log, "w") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", self.module, *args], env=environment, stdout=out,
                stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)

    def alive(self) -> bool:
        return self.process.poll() is None

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def result(self, timeout: float = 600) -> dict:
        self.process.wait(timeout)
        lines = [line for line in self.output().splitlines() if line.startswith("RESULT")]
        assert self.process.returncode == 0 and lines, self.output()[-4000:]
        return json.loads(lines[-1][len("RESULT"):])

    def kill(self) -> None:
        """SIGKILL the writer's whole process group and wait until every member is gone."""
        from prx_assets.testing.processes import wait_for_group_gone

        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(60)
        wait_for_group_gone(self.process.pid)
