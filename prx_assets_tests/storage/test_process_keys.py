"""Process keys: a holder's process told gone only on its own boot and PID namespace, and
only when /proc says so (no such pid, a zombie, another process under the pid)."""

from __future__ import annotations

import os
import subprocess

import pytest

from prx_assets.storage.process_keys import gone, namespace, process_key

pytestmark = pytest.mark.skipif(namespace() is None, reason="needs Linux's /proc")


def test_a_running_process_is_not_gone_and_a_killed_one_is():
    assert not gone(process_key())
    child = subprocess.Popen(["sleep", "600"])
    key = process_key(child.pid)
    try:
        assert key is not None and not gone(key)
        child.kill()
        # A zombie (dead, not yet reaped) is gone: wait for it without reaping it.
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
        assert gone(key)
    finally:
        child.kill()
        child.wait()
    assert gone(key)  # reaped: no such pid


def test_another_process_under_the_same_pid_is_not_the_holder():
    here, _, started = (process_key() or "").rpartition("/")
    assert gone(f"{here}/{int(started) + 1}")  # this pid, another start time
    assert not gone(f"{here}/{started}")


def test_keys_from_elsewhere_or_unreadable_tell_nothing():
    dead = max(int(p) for p in os.listdir("/proc") if p.isdigit()) + 1_000_000
    assert not gone(f"another-boot:pid:[1]/{dead}/1")  # another machine: not concluded
    assert gone(f"{namespace()}/{dead}/1")  # the same pid there would be gone
    for key in (None, "", "garbage", f"{namespace()}/not-a-pid/1", 17):
        assert not gone(key)
    assert process_key(dead) is None
