"""Starting a StreamingDataset while other processes on the machine start theirs.

Every StreamingDataset claims a shared-memory prefix: streaming scans for the first
`/<prefix>_locals` that does not exist, then creates it. Between the scan and the create
there is no lock, so two processes starting a dataset at once (two tree checks, a check and
a trainer, two test workers) can pick the same prefix; the later create then fails with
FileExistsError and the dataset is never built. The prefix the other process took exists by
then, so building again scans past it and claims the next one.

The scan also opens segments of every prefix it passes and never closes them: streaming
registers each handle with `atexit`, which holds it (two file descriptors) until the
process ends. A process that builds many datasets on a machine with many prefixes (live
ones of other processes, stale ones of killed ones) ran out of file descriptors (a test
worker at 20,000), so those handles are closed once the dataset is built.
"""

from __future__ import annotations

import atexit
import gc
import os
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# Each lost race means another process claimed a prefix in the same instant; this many in a
# row is not a race any more but something else holding prefixes, worth its error.
PREFIX_ATTEMPTS = 16
LOCALS_SUFFIX = "_locals"  # streaming's `_get_path(prefix, LOCALS)` name of a claimed prefix


def claiming_prefix(build: Callable[[], T]) -> T:
    """`build()` (which constructs a StreamingDataset), built again while its shared-memory
    prefix was claimed by another process between streaming's scan and its create.

    Only a process that is its machine's only rank retries: the ranks of one distributed job
    agree on their prefix through barriers and the leader's record, which a lone retry by
    one of them would break. Any other error, and a lost race of such a rank, is raised."""
    for attempt in range(1, PREFIX_ATTEMPTS + 1):
        try:
            dataset = build()
        except FileExistsError as error:
            if attempt == PREFIX_ATTEMPTS or not lost_prefix_race(error) or not lone_rank():
                raise
        else:
            close_scanned_prefixes(getattr(dataset, "_shm_prefix_int", None))
            return dataset
    raise AssertionError("unreachable: the last attempt returns or raises")


def close_scanned_prefixes(own_prefix: int | None) -> int:
    """Close this process's handles that streaming's prefix scan opened on other prefixes'
    segments (opened, not created, and not of `own_prefix`: a dataset's own segments, which
    the other ranks of a job open, stay); returns how many were closed."""
    from streaming.base.shared.memory import SharedMemory

    own = None if own_prefix is None else f"{own_prefix:06}_"
    closed = 0
    # `type(o) is`, not isinstance: isinstance reads `__class__`, which some objects (torch's
    # deprecated `reduce_op`) answer with a warning.
    for handle in [o for o in gc.get_objects() if type(o) is SharedMemory]:
        if handle.created_shms or not handle.opened_shms:
            continue
        if own is not None and any(s.name.lstrip("/").startswith(own)
                                   for s in handle.opened_shms):
            continue
        try:
            for segment in handle.opened_shms:
                segment.close()
        except BufferError:  # a buffer of it is still in use: leave it to exit
            continue
        handle.opened_shms = []
        atexit.unregister(handle.cleanup)
        closed += 1
    return closed


def lost_prefix_race(error: FileExistsError) -> bool:
    """Whether the create that failed was streaming's claim of a prefix."""
    return str(error.filename or "").endswith(LOCALS_SUFFIX)


def lone_rank() -> bool:
    """Whether this process is the only rank streaming sees on its machine (no initialised
    torch.distributed group, LOCAL_WORLD_SIZE unset or 1)."""
    if os.environ.get("LOCAL_WORLD_SIZE", "1") != "1":
        return False
    import torch.distributed as dist  # streaming imports torch already; not needed before

    return not (dist.is_available() and dist.is_initialized())
