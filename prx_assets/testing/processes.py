"""Process groups: a run started in its own group is gone only when every process of it is
(Ray workers outlive their raylet for a moment)."""

from __future__ import annotations

import contextlib
import os
import time


def wait_for_group_gone(pgid: int, timeout: float = 30) -> None:
    """Until no process of the group is left (Ray workers exit after their raylet)."""
    import psutil

    deadline = time.time() + timeout
    while time.time() < deadline:
        left = []
        for proc in psutil.process_iter(["pid"]):
            try:
                if os.getpgid(proc.info["pid"]) == pgid:
                    left.append(proc)
            except (ProcessLookupError, psutil.Error, OSError):
                pass
        if not left:
            return
        for proc in left:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        time.sleep(0.1)
    raise AssertionError(f"processes of group {pgid} still alive after SIGKILL")
