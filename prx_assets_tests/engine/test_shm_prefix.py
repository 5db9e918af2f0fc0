"""Two processes starting a StreamingDataset at once: the one whose shared-memory prefix
was claimed between streaming's scan and its create builds again on the next prefix."""

import os

import pytest
from streaming import StreamingDataset

from prx_assets.engine.shm_prefix import claiming_prefix
from prx_assets.stages.shards import stream_counter
from prx_assets.testing.mds_corpus import write_leaf

pytestmark = pytest.mark.usefixtures("fresh_shared_memory")


def test_the_race_fails_a_plain_dataset(tmp_path, claimed_meanwhile):
    leaf = write_leaf(tmp_path / "leaf", 3)
    with pytest.raises(FileExistsError):
        StreamingDataset(local=leaf, batch_size=1, shuffle=False)
    assert len(claimed_meanwhile) == 1


def test_a_dataset_that_lost_the_race_claims_the_next_prefix(tmp_path, claimed_meanwhile):
    leaf = write_leaf(tmp_path / "leaf", 3)
    dataset = claiming_prefix(lambda: StreamingDataset(local=leaf, batch_size=1, shuffle=False))
    assert dataset.num_samples == 3
    assert claimed_meanwhile and dataset._shm_prefix_int not in claimed_meanwhile
    del dataset


def test_the_tree_check_counts_after_losing_the_race(tmp_path, claimed_meanwhile):
    leaves = [write_leaf(tmp_path / "a", 2), write_leaf(tmp_path / "b", 5)]
    assert stream_counter.count_in_this_process(leaves) == [2, 5]
    assert len(claimed_meanwhile) == 1


def failing(times: int, name: str):
    calls = []

    def build():
        calls.append(name)
        if len(calls) <= times:
            raise FileExistsError(17, "File exists", name)
        return len(calls)

    return build, calls


def test_only_a_lost_claim_of_a_prefix_is_retried():
    build, calls = failing(2, "/000007_locals")
    assert claiming_prefix(build) == 3
    build, calls = failing(1, "/000007_barrier")
    with pytest.raises(FileExistsError):
        claiming_prefix(build)
    assert len(calls) == 1


def test_a_rank_of_a_distributed_job_does_not_retry(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    build, calls = failing(1, "/000007_locals")
    with pytest.raises(FileExistsError):
        claiming_prefix(build)
    assert len(calls) == 1


def test_endless_losses_end_in_the_error():
    build, calls = failing(1000, "/000007_locals")
    with pytest.raises(FileExistsError):
        claiming_prefix(build)
    assert 1 < len(calls) < 1000


def shm_descriptors() -> int:
    return sum(os.path.realpath(f"/proc/self/fd/{fd}").startswith("/dev/shm/")
               for fd in os.listdir("/proc/self/fd"))


def test_the_handles_the_scan_opened_on_other_prefixes_are_closed(tmp_path):
    """streaming's prefix scan opens the segments of every prefix it passes and keeps them
    open until the process ends (a test worker ran out of its 20,000 descriptors): a dataset
    built here leaves open only the descriptors of its own segments, however many other
    datasets' prefixes exist."""
    leaf = write_leaf(tmp_path / "leaf", 3)
    others = [claiming_prefix(lambda: StreamingDataset(local=leaf, batch_size=1, shuffle=False))
              for _ in range(4)]
    before = shm_descriptors()
    dataset = claiming_prefix(lambda: StreamingDataset(local=leaf, batch_size=1, shuffle=False))
    own = shm_descriptors() - before
    assert 0 < own <= 2 * 6  # its own six segments (a handle and a map each); not 4 × 6 more
    del dataset, others
