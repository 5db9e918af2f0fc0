"""Ray Data batches as the stages use them: pyarrow tables, typed as such.

Ray types a batch as any of its formats (a pyarrow table, a pandas frame, a dict of numpy
arrays) whatever `batch_format` asks for, and a `map_batches` function as one that takes
the batch alone, though `fn_args` / `fn_kwargs` pass it more. These two helpers say what
the stages rely on, once, instead of a cast or an ignore at every call; neither changes
what Ray does.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import pyarrow as pa
import ray
import ray.data


def arrow_batches(dataset: ray.data.Dataset, batch_size: int | None = 256
                  ) -> Iterable[pa.Table]:
    """`dataset.iter_batches(batch_format="pyarrow")`: every batch is a pyarrow table
    (`batch_size` as Ray's, 256 rows by default; None: whole blocks)."""
    return cast("Iterable[pa.Table]",
                dataset.iter_batches(batch_size=batch_size, batch_format="pyarrow"))


# A model stage with at most this many rows runs in the run's own process: starting an actor
# (a new process importing torch and loading MiniLM, ~7 s here) costs more than the rows.
IN_PROCESS_ROWS = 64


def in_this_process(rows: ray.data.Dataset, fn: Callable[[pa.Table], pa.Table],
                    batch_size: int, schema: pa.Schema) -> ray.data.Dataset:
    """`fn` over the batches of `rows` here, not in Ray workers, as a Dataset again (for a
    few rows: a +1-file run's captions)."""
    outputs = [fn(batch) for batch in arrow_batches(rows, batch_size) if batch.num_rows]
    return dataset_of([put_table(t) for t in outputs or [schema.empty_table()]])


@dataclass(frozen=True)
class PutTable:
    """A table put in Ray's object store, with the block metadata Ray Data wants for it
    (rows, bytes, schema), made where the table was."""

    ref: ray.ObjectRef
    metadata: Any  # ray.data.block.BlockMetadataWithSchema


def put_table(table: pa.Table) -> PutTable:
    from ray.data.block import BlockMetadataWithSchema

    return PutTable(ray.put(table), BlockMetadataWithSchema.from_block(table))


def dataset_of(tables: list[PutTable]) -> ray.data.Dataset:
    """`ray.data.from_arrow_refs` of the tables, with the metadata made when they were put.

    `from_arrow_refs` (and `from_arrow`, which calls it) runs a remote task per table only
    to read its row count and schema back: a task that needs a free CPU and a worker, so
    the driver waited for it (4.7 s of a loaded 2,000-image ingest in `bench.step_costs`,
    ~96 s in a larger run). Built from the Ray Data objects `from_arrow_refs` builds
    (prx_assets_tests/engine/test_batches.py checks them against it)."""
    from ray.data._internal.logical.interfaces import LogicalPlan
    from ray.data._internal.logical.operators.from_operators import FromArrow
    from ray.data._internal.stats import DatasetStats
    from ray.data.context import DataContext
    from ray.data.dataset import MaterializedDataset

    metadata = [table.metadata for table in tables]
    refs: list[Any] = [table.ref for table in tables]  # Ray's two ObjectRef types are one
    context = DataContext.get_current().copy()
    plan = LogicalPlan(FromArrow(refs, metadata), context)
    return MaterializedDataset(plan, context,
                               DatasetStats(metadata={"FromArrow": metadata}, parent=None))


def batch_fn(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` as a `map_batches` function: Ray's type for one takes the batch alone, which
    rejects a function that also takes the `fn_args` / `fn_kwargs` the call passes it."""
    return fn


# Rows one actor should have ahead of it before a model pool starts at full size: below,
# a second model load (torch import and MiniLM, ~6 s of CPU) costs more than it saves.
ROWS_PER_ACTOR = 500

# Model pools of this process's steps running now (`model_step`): a run's `caption_labels`
# and `attributes` run at the same time, and each sized for the whole node, their four
# actors loaded four models on two CPUs (two at a time) for work two could do.
_model_steps = 0
_model_steps_lock = threading.Lock()
# Set in a step the run's executor counted from its launch (`launch_model_step`): the
# step's own `model_step` then counts nothing more.
_counted_by_launcher: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "counted_by_launcher", default=False)


def launch_model_step(context: contextvars.Context) -> None:
    """A model step is launched to run in `context`: counted from now, before its thread
    runs (the executor), so a step launched beside it is counted before either sizes a
    pool; the step's own `model_step` then counts nothing more. Without it each step
    counted itself a second or more into its reading, and the first to size its pool
    took every CPU."""
    _count(1)
    context.run(_counted_by_launcher.set, True)


def leave_model_step() -> None:
    """The launched model step has ended (`launch_model_step`)."""
    _count(-1)


def _count(change: int) -> None:
    global _model_steps
    with _model_steps_lock:
        _model_steps += change


@contextmanager
def model_step() -> Iterator[None]:
    """The block is a step running a model pool: pools sized meanwhile (`actor_pool`) share
    the cluster's CPUs with it (counted already where the executor launched the step)."""
    if _counted_by_launcher.get():
        yield
        return
    _count(1)
    try:
        yield
    finally:
        _count(-1)


def model_steps() -> int:
    """Model steps of this process running now (at least 1: the caller's)."""
    return max(1, _model_steps)


def pool_size(actors: int, threads_per_actor: int, cpus: float) -> int:
    """Actors for a model pool: `actors`, or with 0 one per `threads_per_actor` CPUs of the
    cluster (a single actor left a 2-CPU node half idle for the whole stage)."""
    if actors > 0:
        return actors
    return max(1, int(cpus // max(1, threads_per_actor)))


def actor_pool(actors: int, threads_per_actor: int, pending: int | None = None
               ) -> ray.data.ActorPoolStrategy:
    """A pool of up to `pool_size` actors. Sized by the cluster (`actors` 0) with `pending`
    rows known: one actor per ROWS_PER_ACTOR rows, at most the CPUs' share of each model
    step running now (`model_step`), all started at once (grown one at a time by Ray Data,
    the second actor of a 2-CPU node loaded its model a third of the way into the stage;
    grown past the work, it loaded a model for a few batches). Otherwise from one actor,
    growing while rows are queued up to `pool_size`."""
    cpus = ray.cluster_resources().get("CPU", 1)
    if actors == 0 and pending is not None:
        size = min(pool_size(0, threads_per_actor, cpus / model_steps()),
                   max(1, pending // ROWS_PER_ACTOR))
        return ray.data.ActorPoolStrategy(min_size=1, max_size=size, initial_size=size)
    size = pool_size(actors, threads_per_actor, cpus)
    initial = size if pending and pending >= size * ROWS_PER_ACTOR else 1
    return ray.data.ActorPoolStrategy(min_size=1, max_size=size, initial_size=initial)
