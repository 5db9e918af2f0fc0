"""Ray Data batches as the stages use them: pyarrow tables, typed as such.

Ray types a batch as any of its formats (a pyarrow table, a pandas frame, a dict of numpy
arrays) whatever `batch_format` asks for, and a `map_batches` function as one that takes
the batch alone, though `fn_args` / `fn_kwargs` pass it more. These two helpers say what
the stages rely on, once, instead of a cast or an ignore at every call; neither changes
what Ray does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, cast

import pyarrow as pa
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
    return ray.data.from_arrow(outputs or [schema.empty_table()])


def batch_fn(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` as a `map_batches` function: Ray's type for one takes the batch alone, which
    rejects a function that also takes the `fn_args` / `fn_kwargs` the call passes it."""
    return fn
