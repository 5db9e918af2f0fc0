"""Shared by the MDS tests: each starts and ends without another's stale shared memory."""

import pytest


@pytest.fixture(autouse=True)
def _fresh_shared_memory(fresh_shared_memory):
    yield
