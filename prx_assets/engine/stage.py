"""One per-source stage: what it declares, and the one runner that does the rest.

A per-source stage (labels, attributes, ...) is one small class, as a datatrove step is:
it declares

- `table`: its `TableSpec` (schema, keys, fragment policy);
- `pending(upstream, target)`: what is left to do (`Pending`: the rows, how many, and the
  target rows it removed because their items left upstream);
- `transform(rows, count)`: the Ray stage that turns pending rows into target rows;

and, optionally, which rows of a chunk to commit (`to_commit`), what to count in each
committed chunk (`count`) and whether the run may record what it consumed (`finished`).

`run_stage` does the rest, the same way for every stage: it makes the target exist (so
downstream always finds a table), pins the upstream (the version read is the one recorded),
commits the transform's output chunk by chunk (`engine.chunked.run_chunked`: resumable,
never doubled), records what it consumed (the next run is handed only the changes since),
and returns one `StageReport`. `Coverage` is the one shape of "how much of the upstream the
table covers" the checks and metadata read.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Generic, TypeVar

import pyarrow as pa
import pyarrow.compute as pc
import ray
import ray.data

from prx_assets.engine.chunked import ChunkedReport, ChunkedRun, CommitTarget, NewRows, run_chunked
from prx_assets.storage.changes import consumed_at, record_consumed
from prx_assets.storage.failpoints import failpoint
from prx_assets.storage.lance_tables import (
    FragmentPolicy,
    add_missing_columns,
    adopt_encodings,
    create_empty,
)
from prx_assets.storage.refs import TableRef
from prx_assets.storage.table_stats import value_counts

NODE_COLUMN = "_ray_node"  # transient: which Ray node produced the row (for the metadata)
# A per-source table's fragments: up to 1 GiB or 2²⁰ rows each (blob tables set their own).
PER_SOURCE_FRAGMENTS = FragmentPolicy(target_bytes=1 << 30, max_rows=1 << 20)
EXAMPLES = 5  # failures a report keeps as examples


def with_node_column(batch: pa.Table) -> pa.Table:
    """The batch with the id of the Ray node running this task (fused into the task that
    makes the rows, so it names where the work ran); a schema tag would not survive the
    driver's rebatching into chunks."""
    node = ray.get_runtime_context().get_node_id()
    return batch.append_column(NODE_COLUMN, pa.array([node] * batch.num_rows, pa.string()))


def without_node_column(chunk: pa.Table, nodes: set[str]) -> pa.Table:
    """The chunk without `NODE_COLUMN`, its nodes added to `nodes`."""
    if NODE_COLUMN not in chunk.column_names:
        return chunk
    nodes.update(pc.unique(chunk.column(NODE_COLUMN)).to_pylist())
    return chunk.drop_columns([NODE_COLUMN])


@dataclass(frozen=True)
class TableSpec:
    """The Lance table a stage writes: its schema, the columns that identify a row, and how
    big its fragments grow."""

    schema: pa.Schema
    keys: tuple[str, ...]
    fragments: FragmentPolicy = PER_SOURCE_FRAGMENTS

    def target(self, table: TableRef) -> CommitTarget:
        return CommitTarget(table, self.schema, list(self.keys), self.fragments)

    def ensure(self, table: TableRef) -> int:
        """An empty table where none is yet, so downstream readers and checks find one; an
        older table gets the nullable columns the schema has grown since, and its encoding
        hints."""
        version = create_empty(table, self.schema)
        if add_missing_columns(table, self.schema) + adopt_encodings(table, self.schema):
            return table.open().version
        return version


@dataclass
class Pending:
    """What a run has to do: `count` rows, read lazily (`rows`; None: nothing, no model is
    loaded), after `removed` target rows of items gone upstream were deleted."""

    count: int
    rows: ray.data.Dataset | None
    removed: int = 0
    new_rows: NewRows | None = None  # the rows are absent from the target: append them


@dataclass
class StageReport(ChunkedReport):
    """What one run of a stage did: the runner's commits, the pending count it started
    from, the rows it removed, the upstream version it read, and the stage's own counts
    (`counts`, e.g. per status) with a few failure examples."""

    to_do: int = field(default=0, kw_only=True)
    removed: int = field(default=0, kw_only=True)
    upstream_version: int | None = field(default=None, kw_only=True)
    counts: Counter = field(default_factory=Counter, kw_only=True)
    examples: list[str] = field(default_factory=list, kw_only=True)

    def keep_examples(self, errors: Sequence[str | None]) -> None:
        """Keep the first `EXAMPLES` errors seen (None: no error)."""
        found = [e for e in errors if e is not None]
        self.examples.extend(found[: max(0, EXAMPLES - len(self.examples))])


R = TypeVar("R", bound=StageReport)


class Stage(Generic[R]):
    """A per-source stage, declared; `run_stage` runs it. Subclasses set `table`,
    `upstream` (the name the target's record of its input goes by) and `failpoint`, and
    implement `report` (a new, empty report of theirs), `record_tag`, `pending` and
    `transform`."""

    table: TableSpec
    upstream: ClassVar[str]
    failpoint: ClassVar[str]  # hit after each committed chunk (tests hold or kill a run there)

    def report(self) -> R:
        raise NotImplementedError

    def record_tag(self) -> str:
        """What the target's record of its upstream is made under (a version, a pair)."""
        raise NotImplementedError

    def pending(self, upstream: TableRef, target: TableRef, report: R) -> Pending:
        raise NotImplementedError

    def transform(self, rows: ray.data.Dataset, count: int) -> ray.data.Dataset:
        raise NotImplementedError

    def to_commit(self, chunk: pa.Table) -> pa.Table:
        """The rows of a transformed chunk to write (default: all)."""
        return chunk

    def count(self, chunk: pa.Table, report: R) -> None:
        """Add a committed chunk to the report's own counts."""

    def finished(self, report: R) -> bool:
        """Whether every pending row got its final row: only then is the upstream recorded as
        consumed (a row left to retry is handed on with the same changes)."""
        return True

    def ensure(self, target: TableRef) -> None:
        """Make the target exist before the run (default: an empty table of `table`)."""
        self.table.ensure(target)

    def after(self, upstream: TableRef, target: TableRef, report: R) -> None:
        """Work after the last chunk, before the record (default: none)."""


def run_stage(stage: Stage[R], upstream: TableRef, target: TableRef, chunk_rows: int,
              on_chunk: Callable[[R], None] | None = None) -> R:
    """Bring `target` up to date with `upstream` (pinned here unless the caller pinned it:
    the version read is the one the report and the record name)."""
    report = stage.report()
    stage.ensure(target)
    if not upstream.exists():
        raise FileNotFoundError(f"{upstream} does not exist: materialise {stage.upstream} first")
    upstream = upstream.pinned()
    report.upstream_version = upstream.version
    commit_pending(stage, stage.pending(upstream, target, report), target, chunk_rows, report,
                   on_chunk)
    stage.after(upstream, target, report)
    if stage.finished(report):
        record_consumed(target, stage.upstream, consumed_at(upstream.open(), stage.record_tag()))
    return report


def commit_pending(stage: Stage[R], pending: Pending, target: TableRef, chunk_rows: int,
                   report: R, on_chunk: Callable[[R], None] | None = None) -> R:
    """Transform `pending` and commit it to `target` chunk by chunk, counting each committed
    chunk into `report` (what `run_stage` does between selecting and recording; on its own
    for rows selected elsewhere, e.g. a benchmark's)."""
    report.to_do, report.removed = pending.count, report.removed + pending.removed

    def committed(chunk: pa.Table, run: ChunkedRun) -> None:
        report.commits = run
        # A killed run keeps every chunk committed so far: tests hold or kill it here.
        failpoint(stage.failpoint)
        stage.count(chunk, report)
        if on_chunk:
            on_chunk(report)

    report.commits = run_chunked(pending.rows, lambda rows: stage.transform(rows, report.to_do),
                                 stage.table.target(target), chunk_rows,
                                 to_commit=stage.to_commit, on_chunk=committed,
                                 new_rows=pending.new_rows)
    return report


@dataclass(frozen=True)
class Coverage:
    """How much of its upstream a stage's table covers: `inputs` upstream rows to cover,
    and the table's rows for them by one column's value (a status, a label)."""

    inputs: int
    counts: dict[str, int]

    def rows(self, *values: str) -> int:
        """Rows with one of `values` (every row when none is named)."""
        if not values:
            return sum(self.counts.values())
        return sum(self.counts.get(v, 0) for v in values)

    def share(self, rows: int | None = None) -> float:
        """`rows` (default: every row) as a share of the inputs; 1.0 with no inputs."""
        covered = self.rows() if rows is None else rows
        return covered / self.inputs if self.inputs else 1.0


def coverage(upstream: TableRef, upstream_filter: str | None, table: TableRef, column: str,
             condition: str | None) -> Coverage:
    """Counts for the checks and metadata, from the committed tables (metadata columns
    only): the upstream rows matching `upstream_filter`, the table's rows matching
    `condition` by `column`."""
    inputs = upstream.count_rows(filter=upstream_filter) if upstream.exists() else 0
    if not table.exists():
        return Coverage(inputs, {})
    return Coverage(inputs, dict(value_counts(table, column, condition)))
