"""The jobs' executor: every step of a run in the run's own process, and the steps that are
ready at the same time run together, in threads (at most `max_concurrent`).

Why threads: a process per step (Dagster's multiprocess executor) re-imports the package
and starts Ray for each asset and check (definitions.py), and the serial in-process
executor leaves one of two cores idle for most of a run, waiting on one step at a time
while independent ones (`caption_labels` and `attributes` both read captions; an asset's
checks and the next stage) could go on. The steps' heavy work runs in Ray tasks and
actors, Lance and native code, so their Python threads mostly wait: the run's Ray is shared.

Built from Dagster's own parts, as its in-process executor is: the run's resources are
initialised once and shared by the steps (PlanExecutionContextManager); Dagster's
ActiveExecution decides which steps are ready, which a failure skips, when a retry
(RetryPolicy, RetryRequested) runs and which pool slots (`gpu`) a step waits for; each step
runs Dagster's step sequence (`dagster_event_sequence_for_step`, then its hooks) in a
thread started with a copy of the run thread's context variables, and its events come back
to the run's thread through a queue, in order per step. Events reach the instance where
they are made (SQLite storage serialises its writes under a lock).

`max_concurrent` counts the steps that materialise assets; asset checks run beside them,
outside the limit, as soon as they are ready: a check reads what its asset wrote (a few
seconds at most, in the run's process), and counted, a long one (`jpeg_fidelity`, 9 s of
the driver's CPU) held one of the two slots while the next stages waited, the second core
idle (docs/scale.md). `max_concurrent` 1 (run config `execution: {config: {max_concurrent:
1}}`, or PRX_MAX_CONCURRENT_STEPS=1) is Dagster's serial in-process executor, unchanged.

A run's termination (SIGINT, SIGTERM) reaches the run's thread: it launches no more steps
and raises DagsterExecutionInterruptedError in each running step's thread, as the serial
executor raises it in its step; a thread blocked in native code (a Ray wait, a Lance
write) meets it when it returns to Python.
"""

from __future__ import annotations

import collections
import contextvars
import ctypes
import os
import queue
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial

import dagster as dg
from dagster._core.errors import DagsterExecutionInterruptedError
from dagster._core.events import DagsterEvent, EngineEventData
from dagster._core.execution.api import ExecuteRunWithPlanIterable
from dagster._core.execution.compute_logs import create_compute_log_file_key
from dagster._core.execution.context.system import (
    PlanExecutionContext,
    PlanOrchestrationContext,
    StepExecutionContext,
)
from dagster._core.execution.context_creation_job import PlanExecutionContextManager
from dagster._core.execution.plan.active import ActiveExecution
from dagster._core.execution.plan.execute_plan import (
    _handle_compute_log_setup_error,
    _handle_compute_log_teardown_error,
    _trigger_hook,
    dagster_event_sequence_for_step,
)
from dagster._core.execution.plan.instance_concurrency_context import InstanceConcurrencyContext
from dagster._core.execution.plan.plan import ExecutionPlan
from dagster._core.execution.plan.step import ExecutionStep
from dagster._core.execution.retries import RetryMode, get_retries_config
from dagster._core.executor.base import Executor
from dagster._core.executor.in_process import InProcessExecutor

from prx_assets.engine import batches

MAX_CONCURRENT_ENV = "PRX_MAX_CONCURRENT_STEPS"
# An op tag: the step runs a model pool that shares the CPUs with the run's other model
# steps (`engine.batches.actor_pool`); counted from the step's launch.
MODEL_STEP_TAG = "prx/model_step"
# Steps of one run at a time unless configured: 2, the reference machine's cores; with 2,
# a 2,000-image run took 7-14 % less wall than with 1 for the same CPU (docs/scale.md).
DEFAULT_MAX_CONCURRENT = 2
# How often the run's thread, waiting for step events, looks for a termination request.
INTERRUPT_POLL_S = 0.5


def default_max_concurrent() -> int:
    """Steps at a time: $PRX_MAX_CONCURRENT_STEPS, else DEFAULT_MAX_CONCURRENT."""
    value = os.environ.get(MAX_CONCURRENT_ENV, "").strip()
    return int(value) if value else DEFAULT_MAX_CONCURRENT


@dg.executor(
    name="in_process_concurrent",
    config_schema={
        "retries": get_retries_config(),
        "max_concurrent": dg.Field(
            int, is_required=False,
            description=f"Steps of the run at a time, in threads of the run's process "
                        f"(default ${MAX_CONCURRENT_ENV}, else {DEFAULT_MAX_CONCURRENT}); "
                        "1 runs them one after another (Dagster's in-process executor)."),
    },
)
def in_process_concurrent_executor(init_context: dg.InitExecutorContext) -> Executor:
    """Every step in the run's process, ready steps together in threads (module doc)."""
    config = init_context.executor_config
    retries_config, limit = config["retries"], config.get("max_concurrent")
    assert isinstance(retries_config, Mapping)  # a selector, {"enabled": {}} by default
    retries = RetryMode.from_config(retries_config) or RetryMode.ENABLED
    if not isinstance(limit, int) or limit < 1:
        limit = default_max_concurrent()
    if limit <= 1:
        return InProcessExecutor(retries=retries)
    return ConcurrentInProcessExecutor(retries, limit)


class ConcurrentInProcessExecutor(Executor):
    def __init__(self, retries: RetryMode, max_concurrent: int):
        self._retries = retries
        self.max_concurrent = max_concurrent

    @property
    def retries(self) -> RetryMode:
        return self._retries

    def execute(self, plan_context: PlanOrchestrationContext,
                execution_plan: ExecutionPlan) -> Iterator[DagsterEvent]:
        yield DagsterEvent.engine_event(
            plan_context,
            f"Executing steps in process (pid: {os.getpid()}), up to {self.max_concurrent} "
            "at a time",
            event_specific_data=EngineEventData.in_process(
                os.getpid(), execution_plan.step_keys_to_execute),
        )
        yield from ExecuteRunWithPlanIterable(
            execution_plan=plan_context.execution_plan,
            iterator=partial(concurrent_plan_iterator, max_concurrent=self.max_concurrent),
            execution_context_manager=PlanExecutionContextManager(
                job=plan_context.job,
                retry_mode=plan_context.retry_mode,
                execution_plan=plan_context.execution_plan,
                run_config=plan_context.run_config,
                dagster_run=plan_context.dagster_run,
                instance=plan_context.instance,
                raise_on_error=plan_context.raise_on_error,
                output_capture=plan_context.output_capture,
                step_dependency_config=self.step_dependency_config,
            ),
        )


def concurrent_plan_iterator(job_context: PlanExecutionContext, execution_plan: ExecutionPlan,
                             max_concurrent: int) -> Iterator[DagsterEvent]:
    """Dagster's `inner_plan_execution_iterator` (pool slots, log capture for the process,
    skips after failures), with up to `max_concurrent` steps running at once."""
    with ExitStack() as stack:
        slots = stack.enter_context(
            InstanceConcurrencyContext(job_context.instance, job_context.dagster_run))
        # No limit inside: `_run_steps` holds ready asset steps back past `max_concurrent`.
        active = stack.enter_context(ActiveExecution(
            execution_plan, retry_mode=job_context.retry_mode,
            instance_concurrency_context=slots,
            step_dependency_config=job_context.step_dependency_config))
        yield from _captured_logs(job_context, execution_plan,
                                  _run_steps(job_context, active, max_concurrent))


def _captured_logs(job_context: PlanExecutionContext, execution_plan: ExecutionPlan,
                   events: Iterator[DagsterEvent]) -> Iterator[DagsterEvent]:
    """`events` inside the run's compute-log capture, as Dagster's in-process executor
    captures the logs of its steps (one capture for the process)."""
    manager = job_context.instance.compute_log_manager
    step_keys = [step.key for step in execution_plan.get_steps_to_execute_in_topo_order()]
    log_key = manager.build_log_key_for_run(job_context.run_id, create_compute_log_file_key())
    with ExitStack() as capture:
        try:
            log_context = capture.enter_context(manager.capture_logs(log_key))
            yield DagsterEvent.capture_logs(job_context, step_keys, log_key, log_context)
        except Exception:
            yield from _handle_compute_log_setup_error(job_context, sys.exc_info())
        yield from events
        try:
            capture.close()
        except Exception:
            yield from _handle_compute_log_teardown_error(job_context, sys.exc_info())


@dataclass(frozen=True)
class StepFinished:
    """A step's thread is done; `error` is what escaped its step sequence (raise_on_error,
    an interrupt), for the run's thread to raise."""

    step_key: str
    error: BaseException | None


def is_check_step(step: ExecutionStep) -> bool:
    """A step that only evaluates asset checks (no asset output)."""
    outputs = list(step.step_outputs)
    return bool(outputs) and all(output.properties.asset_check_key is not None
                                 and not output.properties.is_asset for output in outputs)


def _run_steps(job_context: PlanExecutionContext, active: ActiveExecution,
               max_concurrent: int) -> Iterator[DagsterEvent]:
    inbox: queue.SimpleQueue[DagsterEvent | StepFinished] = queue.SimpleQueue()
    running: dict[str, StepThread] = {}
    # Asset steps ready but held back while `max_concurrent` of them run, in Dagster's order.
    held: collections.deque[ExecutionStep] = collections.deque()
    # A step's retry, applied once its thread has ended: applied at once, a retry without a
    # wait would start the step again while the first attempt's thread still runs.
    retries: dict[str, DagsterEvent] = {}
    interrupted = False
    try:
        while running or not active.is_complete:  # a step's end may carry its error
            if active.check_for_interrupts() and not interrupted:
                interrupted = True
                active.mark_interrupted()
                for thread in running.values():
                    thread.interrupt()
            if not interrupted:
                for step in active.get_steps_to_execute():
                    if is_check_step(step):
                        running[step.key] = StepThread(
                            job_context.for_step(step, active.get_known_state()), inbox.put)
                    else:
                        held.append(step)
                while held and sum(not is_check_step(t.step_context.step)
                                   for t in running.values()) < max_concurrent:
                    step = held.popleft()
                    running[step.key] = StepThread(
                        job_context.for_step(step, active.get_known_state()), inbox.put)
            yield from active.concurrency_event_iterator(job_context)
            if not running:
                if interrupted:
                    break
                active.sleep_til_ready()  # a retry's wait or a pool slot
                continue
            try:
                item = inbox.get(timeout=INTERRUPT_POLL_S)
            except queue.Empty:
                continue
            if isinstance(item, DagsterEvent):
                yield item
                if item.is_step_up_for_retry and item.step_key is not None:
                    retries[item.step_key] = item
                else:
                    active.handle_event(item)
                continue
            running.pop(item.step_key).join()
            if item.step_key in retries:
                active.handle_event(retries.pop(item.step_key))
            if item.error is not None and not (
                    interrupted and isinstance(item.error, DagsterExecutionInterruptedError)):
                raise item.error
            active.verify_complete(job_context, item.step_key)
            yield from active.plan_events_iterator(job_context)
    finally:
        for thread in running.values():  # an error above: the others finish their step
            thread.join()
    if interrupted:
        raise DagsterExecutionInterruptedError("the run was terminated while steps ran")


def is_model_step(step: ExecutionStep) -> bool:
    """A step that runs a model pool (its op tagged MODEL_STEP_TAG)."""
    return bool((step.tags or {}).get(MODEL_STEP_TAG))


class StepThread:
    """One step's sequence of events (then its hooks') in a thread of its own, started
    with a copy of the caller's context variables (Dagster's and the leases' run id).

    A model step (`is_model_step`) is counted from here, in the run's thread, until its
    thread ends: steps launched together are all counted before any sizes its pool
    (`engine.batches.launch_model_step`)."""

    def __init__(self, step_context: StepExecutionContext,
                 post: Callable[[DagsterEvent | StepFinished], None]):
        self.step_context = step_context
        self._post = post
        self._lock = threading.Lock()
        self._in_step = False
        context = contextvars.copy_context()
        self._model_step = is_model_step(step_context.step)
        if self._model_step:
            batches.launch_model_step(context)
        self._thread = threading.Thread(
            target=context.run, args=(self._run,),
            name=f"step {step_context.step.key}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        error: BaseException | None = None
        try:
            with self._lock:
                self._in_step = True
            try:
                events = []
                for event in dagster_event_sequence_for_step(self.step_context):
                    events.append(event)
                    self._post(event)
                for event in _trigger_hook(self.step_context, events):
                    self._post(event)
            finally:
                with self._lock:
                    self._in_step = False
                if self._model_step:  # before StepFinished: the next launch counts right
                    batches.leave_model_step()
        except BaseException as exc:  # relayed: the run's thread decides (see _run_steps)
            error = exc
        self._post(StepFinished(self.step_context.step.key, error))

    def interrupt(self) -> None:
        """Raise DagsterExecutionInterruptedError in the step's thread, if it is still in
        its step (Python's thread-interrupt call: signals reach the main thread only)."""
        with self._lock:
            if self._in_step and self._thread.ident is not None:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    ctypes.c_ulong(self._thread.ident),
                    ctypes.py_object(DagsterExecutionInterruptedError))

    def join(self) -> None:
        self._thread.join()


def execute_in_process(job: dg.JobDefinition, instance: dg.DagsterInstance,
                       run_config: dict | None = None, partition_key: str | None = None,
                       raise_on_error: bool = True, tags: dict[str, str] | None = None
                       ) -> dg.ExecuteInProcessResult:
    """`job.execute_in_process`, with the job's own executor where it is this module's:
    Dagster's swaps in its serial in-process executor, and the demo and the benches should
    run what the daemon runs. A job on another executor (Dagster's default, which starts
    processes) runs as `job.execute_in_process` runs it."""
    if job.executor_def is not in_process_concurrent_executor:
        return job.execute_in_process(run_config=run_config, instance=instance,
                                      partition_key=partition_key,
                                      raise_on_error=raise_on_error, tags=tags)
    from dagster._core.definitions.job_base import InMemoryJob
    from dagster._core.execution.execute_in_process import (
        core_execute_in_process,
        merge_run_tags,
    )

    ephemeral = job.as_ephemeral_job(resource_defs={}, input_values={}) \
        .with_executor_def(job.executor_def)
    run_config = dict(run_config or {})
    if not run_config and ephemeral.partitioned_config and partition_key:
        run_config = dict(ephemeral.partitioned_config.get_run_config_for_partition_key(
            partition_key))
    return core_execute_in_process(
        job=InMemoryJob(job_def=ephemeral), run_config=run_config, instance=instance,
        output_capturing_enabled=True, raise_on_error=raise_on_error,
        run_tags=merge_run_tags(job_def=job, partition_key=partition_key, tags=tags,
                                asset_selection=None, instance=instance,
                                run_config=run_config))
