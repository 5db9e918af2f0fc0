"""The writer lease of (asset, source) around an asset body: a second writer of the
partition fails naming the holder once its wait budget is spent, and runs once the holder
is gone; the instance's run queue allows one run per partition."""

import dagster as dg

from prx_assets.storage.layout import Storage
from prx_assets.storage.leases import current_run_id, writer_lease
from prx_assets.testing.mds_corpus import build_corpus
from prx_assets_tests.defs.test_mds_shards import _materialize


def test_a_second_writer_of_a_partition_fails_naming_the_holder(ray_session, data_root,
                                                                monkeypatch):
    build_corpus(data_root, "web", per_shape=2)
    instance = dg.DagsterInstance.ephemeral()
    token = current_run_id.set("the-other-run")
    try:
        holder = writer_lease(Storage(str(data_root)).location(), "mds_shards", "web").acquire()
    finally:
        current_run_id.reset(token)
    monkeypatch.setenv("PRX_LEASE_WAIT_S", "0")
    blocked = _materialize(instance)
    assert not blocked.success
    failure = blocked.failure_data_for_node("mds_shards")
    assert failure is not None and "run the-other-run" in str(failure.error)
    assert not (data_root / "mds").exists() or not list((data_root / "mds").glob("web*"))
    holder.release()
    result = _materialize(instance)
    assert result.success
    lease = data_root / "leases" / "writers" / "mds_shards" / "web.json"
    assert not lease.exists()  # released at the end of the body


def test_the_instance_queues_one_run_per_partition(tmp_path, monkeypatch):
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    instance = dg.DagsterInstance.from_config(str(repo))
    limits = instance.get_concurrency_config().run_queue_config.tag_concurrency_limits
    assert {"key": "dagster/partition", "value": {"applyLimitPerUniqueValue": True},
            "limit": 1} in limits
