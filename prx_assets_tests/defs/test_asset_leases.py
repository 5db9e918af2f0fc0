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
    # A crashed run is launched once more; a step's failure is retried inside the run.
    assert instance.run_retries_enabled and instance.run_retries_max_retries == 1
    assert not instance.run_retries_retry_on_asset_or_op_failure


def test_a_transient_object_store_error_retries_the_step_a_bounded_number_of_times(
        data_root, monkeypatch):
    from prx_assets.defs import asset_leases

    monkeypatch.setattr(asset_leases, "RETRY_WAIT_S", 0)
    attempts: list[int] = []

    def body(context: dg.AssetExecutionContext, failures: int, cause: str) -> None:
        with asset_leases.asset_lease(context, Storage(str(data_root)), "flaky"):
            attempts.append(context.retry_number)
            if len(attempts) <= failures:
                raise OSError(cause)

    @dg.asset
    def twice_503(context: dg.AssetExecutionContext) -> None:
        body(context, 2, "Generic S3 error: Server returned non-2xx status code: 503 "
                         "Service Unavailable: SlowDown")

    assert dg.materialize([twice_503], raise_on_error=False).success
    assert attempts == [0, 1, 2]
    attempts.clear()

    @dg.asset
    def always_503(context: dg.AssetExecutionContext) -> None:
        body(context, 99, "HTTP status 503 Service Unavailable")

    assert not dg.materialize([always_503], raise_on_error=False).success
    assert attempts == [0, 1, 2]  # bounded: TRANSIENT_RETRIES after the first
    attempts.clear()

    @dg.asset
    def refused(context: dg.AssetExecutionContext) -> None:
        body(context, 99, "credentials refused (InvalidAccessKeyId)")

    assert not dg.materialize([refused], raise_on_error=False).success
    assert attempts == [0]  # not transient: no retry
