"""One writer per (asset, source), whatever started the run: every per-source writing asset
runs its body inside `asset_lease` (a lease under `$PRX_DATA_ROOT/leases/writers/`, see
`storage/leases.py` and docs/factory.md). A second run of the same partition waits for the
first (queued before it starts, where Dagster's run queue limits it; here otherwise), takes
over a killed run's lease once it expires, and fails naming the holder past its wait
budget (`PRX_LEASE_WAIT_S`).

Transient failures are retried by Dagster, a bounded number of times: a lease still held
past the wait budget, and an object store's 5xx (`is_transient`) met by the body. The
step runs again from the start (every stage resumes from its commits)."""

from collections.abc import Iterator
from contextlib import contextmanager

import dagster as dg

from prx_assets.storage.layout import Storage
from prx_assets.storage.leases import (
    Lease,
    LeaseHeldError,
    current_run_id,
    default_wait,
    writer_lease,
)
from prx_assets.storage.object_store import ObjectStoreError, is_transient

GLOBAL_PARTITION = "_global"
TRANSIENT_RETRIES = 2  # runs of a step after its first, for transient failures only
RETRY_WAIT_S = 30.0


@contextmanager
def asset_lease(context: dg.AssetExecutionContext | dg.OpExecutionContext, store: Storage,
                asset: str | None = None) -> Iterator[Lease]:
    """Hold the writer lease of (`asset`, default the context's asset; this partition)
    while the body runs; the lease names this run, so a waiting run's log and error say
    which run it waits for."""
    name = asset or context.asset_key.to_user_string()
    # A global asset (corpus) has one writer in all: its lease is named after no source.
    partition = context.partition_key if context.has_partition_key else GLOBAL_PARTITION
    try:
        # First: a lease's own PUT would hide the cause (some S3 servers even create a
        # missing bucket on it), where the run should fail at once naming the root.
        store.check_reachable()
    except ObjectStoreError as exc:
        raise _retry_or_fail(context, exc, transient=is_transient(exc)) from exc
    token = current_run_id.set(context.run_id)
    try:
        with writer_lease(store.location(), name, partition, log=context.log.info) as lease:
            yield lease
    except LeaseHeldError as exc:  # waited its budget; none (0 s): fail at once, as asked
        raise _retry_or_fail(context, exc, transient=default_wait() > 0) from exc
    except Exception as exc:
        if not is_transient(exc):
            raise
        raise _retry_or_fail(context, exc, transient=True) from exc
    finally:
        current_run_id.reset(token)


def _retry_or_fail(context: dg.AssetExecutionContext | dg.OpExecutionContext,
                   exc: Exception, transient: bool) -> Exception:
    """A retry of the step for a transient failure (at most TRANSIENT_RETRIES), else the
    failure with its message."""
    if not transient:
        return dg.Failure(str(exc))
    context.log.warning(f"transient failure, retrying the step (at most {TRANSIENT_RETRIES} "
                        f"times, attempt {context.retry_number + 1}): {exc}")
    return dg.RetryRequested(max_retries=TRANSIENT_RETRIES, seconds_to_wait=RETRY_WAIT_S)
