"""A full build planned in groups of leaves (issue 31): the driver holds one group's plan
at a time, at most `WriteOptions.plan_rows` kept rows, whatever the source's size.

One streamed pass counts the kept rows per leaf (tier, width, height). Consecutive leaves
are packed into groups of up to `plan_rows` rows; a leaf holding more is cut into ranges
of ids, at boundaries read from an evenly spaced sample of its ids (one more streamed pass
over that leaf), so the ranges in order are the leaf in id order. Each group is planned
from a Lance scan filtered on its leaves (and range), its captions by a streamed scan
keeping the group's ids (as are the previous mapping's ids it still holds); its
parts are written, merged into its leaves (a cut leaf's numbering continues across its
ranges) and its mapping rows written as uncommitted fragments that the build commits in
one Overwrite. A source within `plan_rows` is one group: planned, cut and written as a
whole-source plan would be (the same shards, byte for byte). Every full build is grouped,
a rewrite's too (its exclusions applied per group, its sidecars staged per group).

An incremental run that must compare every id (not handed its inputs' changes: no record,
or an input compacted since) compares group by group the same way (`compare_groups`): each
group's plan with the mapping rows of the same leaves (and range), then the mapping rows
of leaves no group plans any more. Only the delta, the work, is held whole.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from itertools import pairwise

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from lance.fragment import FragmentMetadata

from prx_assets.stages.shards.mapping import APPEND_COLUMNS, stage_fragments
from prx_assets.stages.shards.merge import LeafEntries, write_new_leaves
from prx_assets.stages.shards.plan import (
    KEPT,
    Build,
    Delta,
    SampleInputs,
    plan_delta,
    plan_samples,
)
from prx_assets.storage.changes import scan_rows_with_ids
from prx_assets.storage.filters import sql_string
from prx_assets.storage.trees import leaf_name

LeafKey = tuple[int, int, int]
SCAN_ROWS = 1 << 18  # rows per batch of the counting and sampling passes
SAMPLES_PER_RANGE = 64  # ids sampled per range of a cut leaf: boundaries within ~2 %


@dataclass(frozen=True)
class PlanGroup:
    """Consecutive leaves (or one range of ids of one leaf) planned together."""

    leaves: tuple[LeafKey, ...]
    rows: int  # kept rows counted (captioned or not)
    low: str | None = None  # a range of a cut leaf: low <= id < high
    high: str | None = None

    def where(self, whole_source: bool) -> str | None:
        """The bucketed rows of the group (None: every kept row, the source is one group)."""
        if whole_source:
            return None
        leaves = leaf_condition(list(self.leaves))
        bounds = [f"id >= {sql_string(self.low)}" if self.low is not None else "",
                  f"id < {sql_string(self.high)}" if self.high is not None else ""]
        return " AND ".join([f"({leaves})", *(b for b in bounds if b)])


def leaf_condition(keys: list[LeafKey]) -> str:
    return " OR ".join(f"(tier = {t} AND width = {w} AND height = {h})" for t, w, h in keys)


def kept_per_leaf(inputs: SampleInputs) -> dict[LeafKey, int]:
    """Kept rows per leaf, in one streamed pass (a count per leaf, never one per row)."""
    counts: Counter = Counter()
    scanner = inputs.bucketed.open().scanner(columns=["tier", "width", "height"],
                                                   filter=KEPT, batch_size=SCAN_ROWS)
    for batch in scanner.to_batches():
        grouped = pa.Table.from_batches([batch]).group_by(["tier", "width", "height"]) \
            .aggregate([([], "count_all")])
        for row in grouped.to_pylist():
            counts[(row["tier"], row["width"], row["height"])] += row["count_all"]
    return dict(sorted(counts.items()))


def plan_groups(inputs: SampleInputs, counts: dict[LeafKey, int], plan_rows: int
                ) -> list[PlanGroup]:
    """Leaves packed in order into groups of up to `plan_rows` rows; a bigger leaf cut."""
    limit = max(1, plan_rows)
    groups: list[PlanGroup] = []
    packed: list[LeafKey] = []
    rows = 0
    for key, count in counts.items():
        if packed and rows + count > limit:
            groups.append(PlanGroup(tuple(packed), rows))
            packed, rows = [], 0
        if count > limit:
            groups += leaf_ranges(inputs, key, count, math.ceil(count / limit))
            continue
        packed.append(key)
        rows += count
    if packed:
        groups.append(PlanGroup(tuple(packed), rows))
    return groups


def leaf_ranges(inputs: SampleInputs, key: LeafKey, count: int, ranges: int
                ) -> list[PlanGroup]:
    """`key`'s ids cut into about `ranges` ranges of about equal rows."""
    step = max(1, count // (ranges * SAMPLES_PER_RANGE))
    leaf = PlanGroup((key,), count).where(whole_source=False)
    sample: list[str] = []
    seen = 0
    scanner = inputs.bucketed.open().scanner(columns=["id"], filter=f"{KEPT} AND {leaf}",
                                             batch_size=SCAN_ROWS)
    for batch in scanner.to_batches():  # every step-th id in scan order: deterministic
        first = (-seen) % step
        picked = np.arange(first, batch.num_rows, step)
        sample += batch.column("id").take(pa.array(picked)).to_pylist()
        seen += batch.num_rows
    sample.sort()
    bounds = sorted({sample[len(sample) * i // ranges] for i in range(1, ranges)})
    edges: list[str | None] = [None, *bounds, None]
    return [PlanGroup((key,), count // ranges, low, high)
            for low, high in pairwise(edges)]


@dataclass
class GroupedWrite:
    """What a grouped full build wrote before its mapping commit."""

    written: LeafEntries
    fragments: list[FragmentMetadata]
    left_out: Counter
    samples: int
    removed: int  # ids of the previous mapping not planned any more (`rows_removed`)


def write_groups(build: Build) -> GroupedWrite:
    """Every group planned and written in turn into the staged version; the mapping rows
    written as fragments, not committed."""
    groups = plan_groups(build.inputs, kept_per_leaf(build.inputs), build.options.plan_rows)
    build.log(f"{build.source}: planning {sum(g.rows for g in groups):,} kept rows in "
              f"{len(groups)} group(s) of at most {build.options.plan_rows:,}")
    previous = build.mapping.at(build.base_version) if build.base_version else None
    done = GroupedWrite({}, [], Counter(), 0, previous.count_rows() if previous else 0)
    for group in groups:
        plan, left_out = plan_samples(build.inputs, where=group.where(len(groups) == 1))
        new, mapping = write_new_leaves(build, plan, done.written)
        if build.stage_files is not None:  # a group's shards are its own: whole sidecars
            build.stage_files(build.staging, mapping)
        for name, shards in new.items():
            done.written[name] = [*done.written.get(name, []), *shards]
        done.fragments += stage_fragments(build.mapping, mapping)
        done.left_out += left_out
        done.samples += plan.num_rows
        if previous is not None:
            done.removed -= scan_rows_with_ids(previous.open(), plan["id"].combine_chunks(),
                                               ["id"]).num_rows  # still planned
        build.log(f"{build.source}: group {', '.join(leaf_name(*k) for k in group.leaves[:3])}"
                  f"{' ...' if len(group.leaves) > 3 else ''}: {plan.num_rows:,} samples")
    return done


def compare_groups(build: Build) -> tuple[Delta, Counter]:
    """The delta of every id against the mapping at the run's base version, planned and
    compared one group at a time, and the source's rows left out. Mapping rows of the
    same leaves (and range) are read with each group (the mapping keeps each sample's
    tier, width and height); those of leaves no group plans are all superseded."""
    counts = kept_per_leaf(build.inputs)
    # No kept rows: one group of the whole (empty) source, compared with the whole mapping.
    groups = plan_groups(build.inputs, counts, build.options.plan_rows) or [PlanGroup((), 0)]
    mapping = build.mapping.at(build.base_version)
    deltas: list[Delta] = []
    left_out: Counter = Counter()
    for group in groups:
        where = group.where(len(groups) == 1)
        plan, out = plan_samples(build.inputs, where=where)
        deltas.append(plan_delta(plan, mapping.to_table(columns=APPEND_COLUMNS, filter=where)))
        left_out += out
    if len(groups) != 1:  # one group read the whole mapping
        old = mapping.to_table(columns=APPEND_COLUMNS,
                               filter=f"NOT ({leaf_condition(list(counts))})")
        deltas.append(plan_delta(deltas[0].write.slice(0, 0), old))
    build.log(f"{build.source}: {sum(d.write.num_rows for d in deltas):,} of "
              f"{sum(g.rows for g in groups):,} kept rows to write, compared in "
              f"{len(groups)} group(s); left out {dict(left_out) or 'none'}")
    return joined_deltas(deltas), left_out


def joined_deltas(deltas: list[Delta]) -> Delta:
    """The groups' deltas as one. A sample that moved to another leaf is written by its new
    group and superseded in its old one, which also counts it removed: it is not."""
    write = pa.concat_tables([d.write for d in deltas])
    written = write["id"].combine_chunks()
    removed = pa.array([i for d in deltas for i in d.removed_ids], pa.string())
    removed = removed.filter(pc.invert(pc.is_in(removed, value_set=written)))
    return Delta(write=write, stale=pa.concat_tables([d.stale for d in deltas]),
                 removed_ids=sorted(removed.to_pylist()),
                 reused=sum(d.reused for d in deltas))
