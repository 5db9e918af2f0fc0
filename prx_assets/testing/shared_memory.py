"""Freeing the shared memory of StreamingDatasets a test or bench opened, and no one else's.

streaming's own `clean_stale_shared_memory()` is for a machine running one job: it unlinks
every prefix's segments, live ones included, and probes each name by creating it for an
instant. With two test workers (or a bench beside a trainer) that unlinks the other
process's live datasets and makes its next claim of a prefix fail with FileExistsError.
Here a prefix is freed only when every local folder its datasets recorded lies under the
folder given (a test's temporary folder): the caller's own datasets, live or leaked by a
killed child. Nothing is created; each name is only read or unlinked.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
from pathlib import Path
from typing import Any

SHM_FOLDER = Path("/dev/shm")  # where Linux keeps POSIX shared memory, one file per name
LOCALS_NAME = re.compile(r"^(\d{6})_locals$")


def release_shared_memory(under: Path | str) -> list[int]:
    """Unlink the segments of every streaming prefix whose recorded local folders all lie
    under `under`; returns the prefixes freed."""
    from streaming.base.constant import SHM_TO_CLEAN

    root = Path(os.path.abspath(under))
    if not _prefixes_under(root):
        return []  # nothing to free: spare the collection (~0.5 s in a test worker's heap)
    gc.collect()  # this process's dropped datasets free their own segments first
    freed = _prefixes_under(root)
    names = {f"{prefix:06}_{name}" for prefix in freed for name in SHM_TO_CLEAN}
    for name in sorted(names):
        _unlink(name)
    _forget_created(names)
    return freed


def _forget_created(names: set[str]) -> None:
    """This process's streaming handles of the segments just unlinked no longer unlink them
    at cleanup: they live on (atexit holds them), and a later cleanup (`stream_counter.
    release_own_segments`, or the process's exit) would unlink whatever another dataset or
    process has created under the name since. They still close their mappings."""
    from multiprocessing import resource_tracker

    from streaming.base.shared.memory import SharedMemory

    for handle in [o for o in gc.get_objects() if type(o) is SharedMemory]:
        gone = [shm for shm in handle.created_shms if shm.name.lstrip("/") in names]
        if gone:
            handle.created_shms = [shm for shm in handle.created_shms if shm not in gone]
            handle.opened_shms += gone
            for shm in gone:  # nor the resource tracker, at this process's exit
                resource_tracker.unregister(f"/{shm.name}", "shared_memory")  # as registered


def _prefixes_under(root: Path) -> list[int]:
    """The claimed prefixes whose recorded local folders all lie under `root`."""
    return [prefix for prefix in _claimed_prefixes()
            if (folders := _recorded_folders(prefix))
            and all(Path(folder).is_relative_to(root) for folder in folders)]


def _claimed_prefixes() -> list[int]:
    if not SHM_FOLDER.is_dir():
        return []
    return sorted(int(m.group(1)) for m in map(LOCALS_NAME.match, os.listdir(SHM_FOLDER)) if m)


def _recorded_folders(prefix: int) -> list[str]:
    """The local folders streaming recorded for `prefix` (empty if it went meanwhile). Read
    as the file it is under /dev/shm: opening it as SharedMemory would register it with this
    process's resource tracker, which then quarrels with the owner's own unlink."""
    from streaming.base.shared.prefix import _unpack_locals

    try:
        data = (SHM_FOLDER / f"{prefix:06}_locals").read_bytes()
    except FileNotFoundError:
        return []
    folders, _ = _unpack_locals(data)
    return folders


def _unlink(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):  # gone meanwhile: freed by its owner
        os.unlink(SHM_FOLDER / name)


def plain_dataset(**kwargs: Any) -> Any:
    """`streaming.StreamingDataset(**kwargs)` as a trainer opens one, built again when
    another test worker claimed its shared-memory prefix in the same instant
    (`prx_assets.engine.shm_prefix.claiming_prefix`)."""
    from streaming import StreamingDataset

    from prx_assets.engine.shm_prefix import claiming_prefix

    return claiming_prefix(lambda: StreamingDataset(**kwargs))
