"""Shared by the MDS tests: mosaicml-streaming keeps shared memory between datasets of one
process; each test starts and ends without a stale segment of another's."""

import gc

import pytest
from streaming.base.util import clean_stale_shared_memory


@pytest.fixture(autouse=True)
def fresh_shared_memory():
    clean_stale_shared_memory()
    yield
    gc.collect()
    clean_stale_shared_memory()
