"""Telling, on this machine, that the process holding a lease is gone.

A lease names its holder by host and pid, but a pid means something only inside one PID
namespace of one boot of one kernel, and pids are reused. So a holder also records its
process key: the kernel's boot id, the PID namespace, the pid and the process's start time
(clock ticks after boot). A process of the same boot and namespace can then tell from /proc
that the holder is gone (no such pid, a zombie, or another process under that pid), and
take its lease at once instead of after its time to live: a run killed by the OOM killer or
a SIGKILL and started again does not wait two minutes. Anywhere else (another machine,
container or boot, or no /proc) nothing is concluded and the lease expires as before.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

PROC = Path("/proc")


@functools.lru_cache(maxsize=1)
def namespace() -> str | None:
    """'<boot id>:<pid namespace>' of this process, None where /proc does not describe it
    (no /proc, or one mounted from another PID namespace)."""
    try:
        if int(os.readlink(PROC / "self")) != os.getpid():
            return None
        boot = (PROC / "sys/kernel/random/boot_id").read_text().strip()
        pids = os.readlink(PROC / "self/ns/pid")
    except (OSError, ValueError):
        return None
    return f"{boot}:{pids}"


def _stat(pid: int) -> tuple[str, str] | None:
    """(state, start time in clock ticks) of `pid`; None when /proc does not show it."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
        fields = stat[stat.rindex(")") + 2:].split()  # the command name may hold spaces
        return fields[0], fields[19]
    except (OSError, ValueError, IndexError):
        return None


def process_key(pid: int | None = None) -> str | None:
    """'<namespace>/<pid>/<start ticks>' of `pid` (this process by default); None where
    /proc cannot tell."""
    pid = os.getpid() if pid is None else pid
    where = namespace()
    stat = _stat(pid) if where else None
    if where is None or stat is None:
        return None
    return f"{where}/{pid}/{stat[1]}"


def gone(key: object) -> bool:
    """True only when `key` (from `process_key`) names a process of this boot and PID
    namespace that no longer runs: no such pid, a zombie, or a later process under the
    same pid. Anything unreadable, or a key from elsewhere, is not gone."""
    if not isinstance(key, str) or namespace() is None:
        return False
    where, _, started = key.rpartition("/")
    where, _, pid = where.rpartition("/")
    if where != namespace() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)  # the kernel's answer, whatever /proc hides (hidepid)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # another user's process: it exists
    stat = _stat(int(pid))
    return stat is not None and (stat[0] in ("Z", "X") or stat[1] != started)
