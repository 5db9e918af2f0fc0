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
import ray.data

from prx_assets.engine.chunked import ChunkedReport, ChunkedRun, CommitTarget, NewRows, run_chunked
from prx_assets.engine.failpoints import failpoint
from prx_assets.storage.changes import consumed_at, record_consumed
from prx_assets.storage.lance_tables import FragmentPolicy, create_empty
from prx_assets.storage.refs import TableRef
from prx_assets.storage.table_stats import value_counts

# A per-source table's fragments: up to 1 GiB or 2²⁰ rows each (blob tables set their own).
PER_SOURCE_FRAGMENTS = FragmentPolicy(target_bytes=1 << 30, max_rows=1 << 20)
EXAMPLES = 5  # failures a report keeps as examples


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
        """An empty table where none is yet, so downstream readers and checks find one."""
        return create_empty(table, self.schema)


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


def run_stage(stage: Stage[R], upstream: TableRef, target: TableRef, chunk_rows: int,
              on_chunk: Callable[[R], None] | None = None) -> R:
    """Bring `target` up to date with `upstream` (pinned here unless the caller pinned it:
    the version read is the one the report and the record name)."""
    report = stage.report()
    stage.table.ensure(target)
    if not upstream.exists():
        raise FileNotFoundError(f"{upstream} does not exist: materialise {stage.upstream} first")
    upstream = upstream.pinned()
    report.upstream_version = upstream.version
    pending = stage.pending(upstream, target, report)
    report.to_do, report.removed = pending.count, pending.removed

    def committed(chunk: pa.Table, run: ChunkedRun) -> None:
        report.commits = run
        failpoint(stage.failpoint)
        stage.count(chunk, report)
        if on_chunk:
            on_chunk(report)

    report.commits = run_chunked(pending.rows, lambda rows: stage.transform(rows, report.to_do),
                                 stage.table.target(target), chunk_rows,
                                 to_commit=stage.to_commit, on_chunk=committed,
                                 new_rows=pending.new_rows)
    if stage.finished(report):
        record_consumed(target, stage.upstream, consumed_at(upstream.open(), stage.record_tag()))
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
