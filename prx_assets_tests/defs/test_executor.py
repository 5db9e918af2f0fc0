"""The concurrent in-process executor: independent steps of a run at the same time, with
Dagster's failure, skip, retry and check semantics, every event in the instance."""

import os
import signal
import threading
import time

import dagster as dg
import pytest

from prx_assets.defs.executor import (
    MAX_CONCURRENT_ENV,
    default_max_concurrent,
    execute_in_process,
    in_process_concurrent_executor,
)

# Long enough for two threads to meet on a loaded machine; a barrier that cannot be met
# (steps one after another) fails at its timeout whatever it is.
MEET_S = 30.0


def run(assets, instance, max_concurrent=None, checks=(), raise_on_error=False):
    config = {"execution": {"config": {"max_concurrent": max_concurrent}}} \
        if max_concurrent else {}
    defs = dg.Definitions(assets=assets, asset_checks=list(checks), jobs=[
        dg.define_asset_job("job", executor_def=in_process_concurrent_executor)])
    return execute_in_process(defs.resolve_job_def("job"), instance, run_config=config,
                              raise_on_error=raise_on_error)


def meeting_assets(timeout: float):
    """Two independent assets that finish only if both run at once, and a check on one."""
    barrier = threading.Barrier(2, timeout=timeout)

    @dg.asset
    def left() -> int:
        barrier.wait()
        return 1

    @dg.asset
    def right() -> int:
        barrier.wait()
        return 2

    @dg.asset_check(asset=left)
    def left_is_one(left: int) -> dg.AssetCheckResult:
        return dg.AssetCheckResult(passed=left == 1)

    return [left, right], [left_is_one]


@pytest.fixture(scope="module")
def instance():
    with dg.instance_for_test() as instance:  # SQLite storage, as a local run has
        yield instance


def test_independent_steps_run_at_the_same_time(instance):
    assets, checks = meeting_assets(MEET_S)
    result = run(assets, instance, checks=checks)
    assert result.success
    assert [e.passed for e in result.get_asset_check_evaluations()] == [True]


def test_checks_run_beside_the_steps_outside_the_limit(instance):
    """Two asset steps (the limit) and a check ready at the same time all run at once: a
    long check does not hold a slot the next stages wait for."""
    barrier = threading.Barrier(3, timeout=MEET_S)

    @dg.asset
    def up() -> int:
        return 1

    @dg.asset
    def left(up: int) -> int:
        barrier.wait()
        return up

    @dg.asset
    def right(up: int) -> int:
        barrier.wait()
        return up

    @dg.asset_check(asset=up)
    def up_is_one(up: int) -> dg.AssetCheckResult:
        barrier.wait()
        return dg.AssetCheckResult(passed=up == 1)

    result = run([up, left, right], instance, max_concurrent=2, checks=[up_is_one])
    assert result.success
    assert [e.passed for e in result.get_asset_check_evaluations()] == [True]


def test_asset_steps_past_the_limit_wait(instance):
    """Three ready asset steps under a limit of two: never three at once."""
    running, most, lock = set(), [0], threading.Lock()

    def counted(name: str):
        @dg.asset(name=name)
        def step() -> int:
            with lock:
                running.add(name)
                most[0] = max(most[0], len(running))
            time.sleep(0.3)
            with lock:
                running.discard(name)
            return 1
        return step

    result = run([counted(n) for n in ("a", "b", "c")], instance, max_concurrent=2)
    assert result.success
    assert 1 <= most[0] <= 2


def test_max_concurrent_one_runs_steps_one_after_another(instance):
    assets, checks = meeting_assets(0.2)  # never met: the first step fails at its timeout
    result = run(assets, instance, max_concurrent=1, checks=checks)
    assert not result.success
    assert len(result.get_step_failure_events()) == 2  # the second met a broken barrier


def test_every_event_lands_in_the_instance(instance):
    assets, checks = meeting_assets(MEET_S)
    result = run(assets, instance, checks=checks)
    stored = [record.dagster_event for record in instance.all_logs(result.run_id)
              if record.dagster_event is not None  # less what the run's creation logs
              and not record.dagster_event.event_type_value.endswith("_PLANNED")]
    assert sorted((e.event_type_value, e.step_key) for e in stored) == \
        sorted((e.event_type_value, e.step_key) for e in result.all_events)
    assert {e.step_key for e in stored if e.event_type_value == "STEP_SUCCESS"} == \
        {"left", "right", "left_left_is_one"}
    for key in ("left", "right"):
        assert instance.get_latest_materialization_event(dg.AssetKey(key)) is not None


def test_a_failure_skips_its_dependents_only(instance):
    @dg.asset
    def broken() -> int:
        raise ValueError("broken")

    @dg.asset
    def after_broken(broken: int) -> int:
        return broken

    @dg.asset
    def fine() -> int:
        return 1

    @dg.asset
    def after_fine(fine: int) -> int:
        return fine + 1

    result = run([broken, after_broken, fine, after_fine], instance)
    assert not result.success
    assert [e.step_key for e in result.get_step_failure_events()] == ["broken"]
    assert {e.step_key for e in result.all_events if e.is_step_start} == \
        {"broken", "fine", "after_fine"}
    assert {e.asset_key.to_user_string() for e in result.get_asset_materialization_events()} \
        == {"fine", "after_fine"}


def failing_once(name: str, attempts: list[int], max_retries: int) -> dg.AssetsDefinition:
    """An asset whose first attempt fails (a transient error its retry policy retries)."""

    @dg.asset(name=name, retry_policy=dg.RetryPolicy(max_retries=max_retries))
    def failing(context: dg.AssetExecutionContext) -> int:
        attempts.append(context.retry_number)
        if context.retry_number == 0:
            raise RuntimeError("transient")
        return 1

    return failing


def test_a_retried_step_runs_again_beside_the_others(instance):
    attempts: list[int] = []
    flaky = failing_once("flaky", attempts, max_retries=2)

    @dg.asset
    def requested(context: dg.AssetExecutionContext) -> int:
        if context.retry_number == 0:
            raise dg.RetryRequested(max_retries=1)
        return 2

    @dg.asset
    def downstream(flaky: int, requested: int) -> int:
        return flaky + requested

    result = run([flaky, requested, downstream], instance)
    assert result.success
    assert attempts == [0, 1]
    assert result.output_for_node("downstream") == 3
    assert {e.step_key for e in result.all_events
            if e.event_type_value == "STEP_UP_FOR_RETRY"} == {"flaky", "requested"}


def test_a_step_retried_at_once_waits_for_its_first_attempt_to_end(instance):
    """A retry without a wait is ready as soon as its event arrives, while the first
    attempt's thread is still finishing: the second attempt must not start before that."""
    attempts: list[int] = []
    result = run([failing_once("alone", attempts, max_retries=1)], instance)
    assert result.success and attempts == [0, 1]


def test_raise_on_error_raises_the_steps_error(instance):
    @dg.asset
    def broken() -> int:
        raise ValueError("broken on purpose")

    with pytest.raises(ValueError, match="broken on purpose"):
        run([broken], instance, raise_on_error=True)


def test_termination_interrupts_the_running_steps(instance):
    """SIGINT reaches the run's thread; the running step meets the interrupt in its own
    thread (it would otherwise wait out its loop and succeed) and its dependent never runs."""
    stopped = threading.Event()

    @dg.asset
    def long_step() -> int:
        os.kill(os.getpid(), signal.SIGINT)  # Dagster's handler turns it into a request
        try:
            for _ in range(int(MEET_S / 0.01)):
                time.sleep(0.01)
        except BaseException:
            stopped.set()
            raise
        return 1

    @dg.asset
    def after(long_step: int) -> int:
        return long_step

    result = run([long_step, after], instance)
    assert stopped.is_set() and not result.success
    assert "after" not in {e.step_key for e in result.all_events if e.is_step_start}


def test_the_default_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(MAX_CONCURRENT_ENV, "3")
    assert default_max_concurrent() == 3
    monkeypatch.delenv(MAX_CONCURRENT_ENV)
    assert default_max_concurrent() == 2


def test_model_steps_launched_together_are_counted_before_either_sizes_its_pool(instance):
    """`caption_labels` and `attributes` start together; each enters `model_step` after a
    second or more of reading, and the first to size its pool took every CPU while the
    other had not entered yet (its actor then waited for the CPUs, the two one after the
    other). Launched together, both are counted from the launch."""
    from prx_assets.defs.executor import MODEL_STEP_TAG
    from prx_assets.engine import batches

    first_sized, seen = threading.Event(), {}

    @dg.asset
    def up() -> int:
        return 1

    @dg.asset(op_tags={MODEL_STEP_TAG: "true"})
    def quick(up: int) -> int:
        with batches.model_step():
            seen["quick"] = batches.model_steps()  # sizes its pool at once
        first_sized.set()
        return up

    @dg.asset(op_tags={MODEL_STEP_TAG: "true"})
    def slow(up: int) -> int:
        assert first_sized.wait(MEET_S)  # its reading outlasts the other's
        with batches.model_step():
            seen["slow"] = batches.model_steps()
        return up

    @dg.asset
    def untagged(up: int) -> int:
        return up

    result = run([up, quick, slow, untagged], instance, max_concurrent=3)
    assert result.success
    assert seen == {"quick": 2, "slow": 2}
    assert batches.model_steps() == 1 and batches._model_steps == 0  # all left


def test_the_two_model_steps_are_tagged():
    """caption_labels and attributes share the CPUs from their launch (the test above)."""
    from prx_assets.defs.attributes import build_attributes
    from prx_assets.defs.executor import MODEL_STEP_TAG
    from prx_assets.defs.labels import build_caption_labels

    partitions = dg.StaticPartitionsDefinition(["a"])
    for asset in (build_caption_labels(partitions), build_attributes(partitions)):
        assert asset.op.tags.get(MODEL_STEP_TAG) == "true"
