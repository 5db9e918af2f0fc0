"""Writer processes for the concurrency and kill tests on the S3 server: each is
`python -m prx_assets.testing.s3_writers <mode> ...` in a process of its own, armed
(or not) with a failpoint or a barrier through its environment (`storage.failpoints`).

    upsert URI NAME          one upsert of NAME0..NAME2 plus the key `shared`
    chunked URI ROWS CHUNK   ids c000.. committed by `engine.chunked.run_chunked` in chunks
                             of CHUNK, resuming: only ids not yet in the table are written
    overwrite URI NAME       the whole table replaced by NAME0..NAME4 through Ray
                             (`write_dataset_atomically`)
    replace URI NAME         the "source" rows (v > 0: s0..s4) replaced in one commit by
                             s0..s4 valued after NAME (`replace_where`, as `corpus` does)
    replace-ids URI NAME     the same, deleting by id as a corpus update does: the ids it
                             writes and s9, a held id it plans to remove

Each prints one line `RESULT{json}` when it finishes; warnings go to stderr.
"""

from __future__ import annotations

import json
import logging
import sys
import time

import pyarrow as pa

from prx_assets.storage.refs import TableRef
from prx_assets.testing import writer_process

SCHEMA = pa.schema([("id", pa.string()), ("v", pa.int64())])


def rows(ids: list[str], value: int) -> pa.Table:
    return pa.table({"id": ids, "v": [value] * len(ids)}, schema=SCHEMA)


def chunk_ids(count: int) -> list[str]:
    return [f"c{i:03d}" for i in range(count)]


def upsert_main(uri: TableRef, name: str) -> dict:
    from prx_assets.storage.lance_tables import upsert

    value = sum(name.encode())
    return {"version": upsert(uri, rows([f"{name}{i}" for i in range(3)] + ["shared"], value),
                              SCHEMA, ["id"])}


def chunked_main(uri: TableRef, count: int, chunk: int) -> dict:
    import ray.data

    from prx_assets.engine import ray_runtime
    from prx_assets.engine.chunked import CommitTarget, pending_rows, run_chunked

    ray_runtime.connect(num_cpus=1)
    wanted = ray.data.from_arrow(rows(chunk_ids(count), 0).select(["id"]))
    pending = pending_rows(wanted, uri)
    run = run_chunked(pending, lambda ds: ds.map_batches(
        lambda batch: batch.append_column("v", pa.array([1] * batch.num_rows, pa.int64())),
        batch_format="pyarrow"), CommitTarget(uri, SCHEMA, ["id"]), chunk)
    return {"commits": run.commits, "committed": run.committed, "version": run.lance_version}


class WriterProcess(writer_process.WriterProcess):
    module = "prx_assets.testing.s3_writers"


def wait_until(condition, writers: list[WriterProcess], what: str, guard_s: float = 900) -> None:
    """Poll `condition` until it holds; fail at once if a writer exits first. `guard_s` only
    stops a hung test: nothing here races a timer."""
    deadline = time.monotonic() + guard_s
    while not condition():
        for writer in writers:
            if not writer.alive():
                raise AssertionError(f"a writer exited before {what}:\n"
                                     f"{writer.output()[-4000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"hung waiting for {what}")
        time.sleep(0.05)


def overwrite_main(uri: TableRef, name: str) -> dict:
    import ray.data

    from prx_assets.engine import ray_runtime
    from prx_assets.storage.lance_tables import (
        CommitConflictError,
        FragmentPolicy,
        write_dataset_atomically,
    )

    ray_runtime.connect(num_cpus=1)
    data = ray.data.from_arrow(rows([f"{name}{i}" for i in range(5)], sum(name.encode())))
    try:
        return {"version": write_dataset_atomically(data, uri, FragmentPolicy(), SCHEMA).version}
    except CommitConflictError as exc:
        return {"conflict": str(exc)}


# The rows one `replace` writer owns: a source's corpus rows in miniature.
REPLACED = "v > 0"


def replaced_ids() -> list[str]:
    return [f"s{i}" for i in range(5)]


def replace_main(uri: TableRef, name: str, by_id: bool = False) -> dict:
    from prx_assets.storage.filters import all_of, in_filter
    from prx_assets.storage.replace import replace_where, write_uncommitted

    fragments, _ = write_uncommitted(uri, [rows(replaced_ids(), sum(name.encode()))], SCHEMA)
    where = all_of(REPLACED, in_filter("id", [*replaced_ids(), "s9"])) if by_id else REPLACED
    version, deleted = replace_where(uri, where or REPLACED, fragments)
    return {"version": version, "deleted": deleted}


def main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    mode, location, *rest = argv
    uri = TableRef.of(location)
    if mode == "upsert":
        result = upsert_main(uri, rest[0])
    elif mode == "overwrite":
        result = overwrite_main(uri, rest[0])
    elif mode in ("replace", "replace-ids"):
        result = replace_main(uri, rest[0], by_id=mode == "replace-ids")
    elif mode == "chunked":
        result = chunked_main(uri, int(rest[0]), int(rest[1]))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    print("RESULT" + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
