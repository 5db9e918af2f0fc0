"""Freeing the shared memory under one folder leaves every other process's datasets alone."""

import os
from pathlib import Path

import pytest
from streaming import MDSWriter, StreamingDataset

from prx_assets.testing.shared_memory import SHM_FOLDER, release_shared_memory

pytestmark = pytest.mark.usefixtures("fresh_shared_memory")


def leaf_dataset(folder: Path) -> StreamingDataset:
    with MDSWriter(out=str(folder), columns={"id": "str"}) as writer:
        writer.write({"id": "only"})
    return StreamingDataset(local=str(folder), batch_size=1, shuffle=False)


def segments(prefix: int) -> set[tuple[str, int]]:
    """(name, inode) of the prefix's segments: a name freed can be taken again at once by
    another process (streaming hands the lowest free prefix to the next dataset on the
    machine, another test worker's included), so a segment is known by its inode."""
    return {(entry.name, entry.inode()) for entry in os.scandir(SHM_FOLDER)
            if entry.name.startswith(f"{prefix:06}_")}


def test_only_prefixes_whose_folders_lie_under_the_folder_are_freed(tmp_path):
    mine = leaf_dataset(tmp_path / "mine" / "leaf")
    theirs = leaf_dataset(tmp_path / "theirs" / "leaf")
    mine_before, theirs_before = segments(mine._shm_prefix_int), segments(theirs._shm_prefix_int)
    assert mine_before and theirs_before

    assert release_shared_memory(tmp_path / "mine") == [mine._shm_prefix_int]

    assert not mine_before & segments(mine._shm_prefix_int)
    # Another prefix's segments neither unlinked nor made again (streaming's own cleaner
    # probes by creating).
    assert segments(theirs._shm_prefix_int) == theirs_before
    assert theirs[0]["id"] == "only"  # still reads its own shared state
    assert release_shared_memory(tmp_path / "nobody") == []
    del mine, theirs


def test_a_freed_name_taken_again_is_not_unlinked_by_the_old_handles(tmp_path):
    """The datasets' handles outlive the release (atexit holds them): their cleanup must not
    unlink a segment created under the same name afterwards (another process's)."""
    from multiprocessing import shared_memory

    from prx_assets.stages.shards.stream_counter import release_own_segments

    mine = leaf_dataset(tmp_path / "mine" / "leaf")
    prefix = mine._shm_prefix_int
    assert release_shared_memory(tmp_path / "mine") == [prefix]
    theirs = shared_memory.SharedMemory(f"{prefix:06}_locals", create=True, size=8)
    try:
        release_own_segments()
        assert f"{prefix:06}_locals" in os.listdir(SHM_FOLDER)
    finally:
        theirs.close()
        theirs.unlink()
    del mine
