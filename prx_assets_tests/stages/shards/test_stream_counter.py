"""The kept counting child: one per process, serving counts with the caller's environment of
the moment; errors come back with their message; a dead child is replaced."""

import os
import signal

import pytest

from prx_assets.stages.shards import stream_counter
from prx_assets.stages.shards.stream_counter import StreamCounter
from prx_assets.testing.mds_corpus import write_leaf


@pytest.fixture
def counter():
    counter = StreamCounter()
    yield counter
    counter.close()


@pytest.fixture
def leaves(tmp_path) -> list[str]:
    return [write_leaf(tmp_path / "a", 2), write_leaf(tmp_path / "b", 5)]


def test_one_child_answers_counts_errors_and_the_environment_of_each_call(
        counter, leaves, tmp_path, monkeypatch):
    assert counter.counts(leaves) == [2, 5]
    child = counter.pid
    descriptors = len(os.listdir(f"/proc/{child}/fd"))
    with pytest.raises(Exception, match="no-such-leaf"):
        counter.counts([str(tmp_path / "no-such-leaf")])
    # streaming reads its world from the environment: the caller's, as it is at each call.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "not-a-number")
    with pytest.raises(ValueError, match="not-a-number"):
        counter.counts(leaves)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert counter.counts(leaves[1:]) == [5]
    assert counter.pid == child
    # Each dataset's shared memory is released after its count, not at the child's exit.
    assert len(os.listdir(f"/proc/{child}/fd")) == descriptors


def test_a_killed_child_is_replaced_and_a_worn_one_retired(counter, leaves, monkeypatch):
    assert counter.counts(leaves) == [2, 5]
    first = counter.pid
    assert first is not None
    os.kill(first, signal.SIGKILL)
    assert counter.counts(leaves) == [2, 5]
    second = counter.pid
    assert second not in (None, first)

    monkeypatch.setattr(stream_counter, "REQUESTS_PER_CHILD", 2)
    assert counter.counts(leaves[:1]) == [2]  # the second count of this child: it retires
    assert counter.pid is None
