"""Each fault-test module gets its own small corpus (`prx_assets.testing.fault_corpus`), so
the modules are independent and `--dist loadfile` spreads them over the test workers."""

import pytest

from prx_assets.testing.fault_corpus import built_corpus


@pytest.fixture(scope="module")
def corpus(ray_session, tmp_path_factory):
    with built_corpus(tmp_path_factory.mktemp("faults")) as built:
        yield built
