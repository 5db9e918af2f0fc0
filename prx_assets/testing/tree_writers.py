"""Tree writers for the race tests, each `python -m prx_assets.testing.tree_writers
<mode> ROOT ...` in a process of its own, lined up by barriers (`storage.failpoints`) armed
through its environment:

    mds ROOT            an mds_shards build of source `web` (incremental, small shards)
    skip ROOT ID...     skip lists of `web` with the ids as `dedup`

Each prints `RESULT{json}` when it finishes; an error prints `ERROR{json}` and exits 1.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prx_assets.storage import failpoints
from prx_assets.testing.writer_process import WriterProcess


def kill_held_at(script: str, args: list[str], point: str, marker: Path) -> None:
    """Run `script` in a child with `point` armed (and a tree lease that expires a second
    after the kill), wait until it holds there (not a race), and SIGKILL it."""
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "PRX_LEASE_TTL_S": "1",
           **failpoints.env(point, marker)}
    child = subprocess.Popen([sys.executable, "-c", script, *args], env=env)
    try:
        while failpoints.read_marker(marker) is None:
            try:
                child.wait(0.2)
                pytest.fail(f"the child exited before reaching {point}")
            except subprocess.TimeoutExpired:
                pass
        child.kill()
        child.wait()
    finally:
        if child.poll() is None:
            child.kill()


def mds_main(root: str) -> dict:
    from prx_assets.stages.shards import mds
    from prx_assets.testing.mds_corpus import WRITE_OPTIONS, inputs_for

    report = mds.write_mds_tree(inputs_for(root, "web"), root, "web", WRITE_OPTIONS)
    return {"tree_version": report.tree_version, "processed": report.processed}


def skip_main(root: str, ids: list[str]) -> dict:
    from prx_assets.stages.skip_lists.skip_lists import apply_reasons
    from prx_assets.storage.layout import Storage

    run = apply_reasons(Storage(root), "web", {"dedup": set(ids)})
    return {"skipped": run.report.skipped_total}


class Writer(WriterProcess):
    module = "prx_assets.testing.tree_writers"


def main(argv: list[str]) -> None:
    # The stages log through `logging`: a lease wait or takeover shows in the writer's log.
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
    mode, root, *rest = argv
    try:
        result = mds_main(root) if mode == "mds" else skip_main(root, rest)
    except Exception as exc:
        print("ERROR" + json.dumps({"type": type(exc).__name__, "error": str(exc)}), flush=True)
        raise SystemExit(1) from exc
    print("RESULT" + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
