import os

import pytest

from prx_assets.engine.ray_runtime import (
    MALLOC_ENV,
    OBJECT_STORE_FLOOR,
    OBJECT_STORE_PER_CPU,
    default_object_store_bytes,
    return_freed_memory,
)

GIB = 1 << 30


def test_the_object_store_scales_with_cpus_within_a_share_of_memory():
    assert default_object_store_bytes(2, 24 * GIB) == OBJECT_STORE_FLOOR
    assert default_object_store_bytes(16, 128 * GIB) == 16 * OBJECT_STORE_PER_CPU
    # A small machine gets Ray's own share of its memory, never more.
    assert default_object_store_bytes(16, 8 * GIB) == int(0.3 * 8 * GIB)


def test_workers_return_freed_buffers_to_the_system():
    assert int(MALLOC_ENV["MALLOC_MMAP_THRESHOLD_"]) <= 1 << 20
    return_freed_memory()  # the driver's side: callable in any process, twice
    return_freed_memory()


def test_ray_data_blocks_are_sized_to_the_cluster(ray_session):
    import ray
    import ray.data

    from prx_assets.engine.ray_runtime import MAX_BLOCK_BYTES, configure_ray_data

    configure_ray_data()
    context = ray.data.DataContext.get_current()
    cpus = int(ray.cluster_resources()["CPU"])
    assert context.read_op_min_num_blocks == max(2, 2 * cpus) < 200  # not Ray's default
    assert context.target_max_block_size == MAX_BLOCK_BYTES


def test_workers_do_not_inherit_the_drivers_credentials(ray_session):
    """Embedded workers once inherited the driver's whole environment: a worker's
    environment dump showed OPENAI_API_KEY and AWS_* keys. The session's Ray started with a
    canary credential in the driver's environment (conftest)."""
    import ray

    from prx_assets.engine.redact import credential_names

    held = credential_names()
    assert "PRX_TEST_CANARY_API_KEY" in held

    @ray.remote(num_cpus=0)
    def worker_environment() -> dict[str, str]:
        return dict(os.environ)

    seen = ray.get(worker_environment.remote())
    assert not set(held) & set(seen)
    assert seen["HF_HUB_OFFLINE"] and "PATH" in seen  # what workers need still reaches them


# An exception the thread let through would be this warning (pytest's thread hook).
@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_ray_data_starts_on_a_thread_of_its_own_and_leaves_its_failures_to_the_stages(
        monkeypatch):
    """Ray Data's first run (its actors and a worker starting, seconds) goes on beside the
    caller, not in the first stage; a failure there is the stages' to meet, not a crash."""
    import threading

    import ray.data

    from prx_assets.engine import ray_runtime

    ran_on = []

    def no_cluster(rows: list):
        ran_on.append(threading.current_thread())
        raise RuntimeError("no cluster")

    monkeypatch.setattr(ray.data, "from_items", no_cluster)
    thread = ray_runtime.start_ray_data()
    thread.join()
    assert ran_on == [thread] and thread is not threading.main_thread()
