"""An incremental build handed its inputs' changes (issue 31): the ids whose samples may
differ from the current tree's are found from the inputs' fragments (`storage.changes`),
and only their rows are planned and compared with the mapping table, looked up by id.
A +1-file run on a 10⁸-row source then reads a few rows, not 10⁸ ids and fingerprints.

Each tree's manifest records what its build consumed of its pinned inputs (`consumed`: a
`storage.changes.Consumed` per input table), written with the tree, so the record is
published, rolled forward or lost together with the mapping it describes. A build of other
samples than its inputs' (a rewrite's exclusions) records nothing: the next run compares
in full, as it does without a record, after a compaction of an input, past
`HANDED_LIMIT` rows written to one, or when an input is pinned older than the record.

A run that finds nothing to change publishes no tree, so the manifest's record would stay
where the tree was built and every later run would be handed the same changes again (a
caption version that is not the active one, rows left out), growing toward the limit. Such
a run records what it consumed beside the trees instead (`NO_CHANGE_RECORD`, naming the
tree it found unchanged, written under the tree lease); a record naming another tree than
the current one is ignored.
"""

from __future__ import annotations

import json
from collections import Counter

import pyarrow as pa
import pyarrow.compute as pc

from prx_assets.stages.shards.mapping import APPEND_COLUMNS
from prx_assets.stages.shards.plan import KEPT, Delta, SampleInputs, plan_delta, plan_samples
from prx_assets.storage.changes import (
    Consumed,
    added_ids,
    consumed_at,
    pinned_changes,
    rows_with_ids,
)
from prx_assets.storage.refs import Location, TableRef
from prx_assets.storage.tables import BUCKETED_IMAGES, CAPTIONS, RAW_IMAGES

# Rows written to one input since the tree above which comparing every id costs less
# than looking each one up (~5 µs an id looked up against ~1 µs an id compared in full).
HANDED_LIMIT = 1_000_000
NO_CHANGE_RECORD = "unchanged.json"  # in the source's trees folder: {"tree", "consumed"}


def input_tables(inputs: SampleInputs) -> dict[str, TableRef]:
    """The tables whose rows make a sample: its image, its caption and, where the source
    has one, its raw_images row (the provenance the sample carries; a tree recorded before
    it counted is compared in full once)."""
    tables = {BUCKETED_IMAGES: inputs.bucketed, CAPTIONS: inputs.captions}
    if inputs.raw is not None:
        tables[RAW_IMAGES] = inputs.raw
    return tables


def consumed_inputs(inputs: SampleInputs) -> dict[str, str] | None:
    """The manifest's record of the pinned inputs a build consumed whole; None for a build
    that leaves samples of its inputs out (`exclude_ids`)."""
    if inputs.leaves_out:
        return None
    return {name: consumed_at(table.open()).to_json()
            for name, table in input_tables(inputs).items()}


def record_unchanged(trees_dir: Location, tree: str, inputs: SampleInputs) -> None:
    """Record that `tree` holds what `inputs` plan (a run found nothing to change)."""
    consumed = consumed_inputs(inputs)
    if consumed is not None:
        (trees_dir / NO_CHANGE_RECORD).write_text(
            json.dumps({"tree": tree, "consumed": consumed}, sort_keys=True))


def consumed_record(trees_dir: Location, tree: str, manifest: dict) -> object:
    """What tree `tree` is known to hold of its inputs: a later run's record of finding it
    unchanged, else its manifest's record of the build (None without either)."""
    try:
        unchanged = json.loads((trees_dir / NO_CHANGE_RECORD).read_text())
    except (OSError, ValueError):
        unchanged = None
    if isinstance(unchanged, dict) and unchanged.get("tree") == tree:
        return unchanged.get("consumed")
    return manifest.get("consumed")


def touched_ids(inputs: SampleInputs, records: object) -> pa.Array | None:
    """Ids written to or deleted from either input since `records` (`consumed_record`);
    None when that cannot be told cheaply (see the module's text)."""
    if not isinstance(records, dict) or inputs.leaves_out:
        return None
    found: list[pa.Array] = []
    for name, table in input_tables(inputs).items():
        try:
            since = Consumed.from_json(records[name])
        except (KeyError, ValueError, TypeError):
            return None
        changes = pinned_changes(table, since, HANDED_LIMIT)
        if changes is None or changes.deleted is None:
            return None
        # Every deleted id, held still or not: deleting an id's active caption while an
        # older version's row stays changes its sample all the same.
        found += [ids.cast(pa.string()) for ids in (added_ids(table, changes, None),
                                                    changes.deleted)]
    return pc.unique(pa.concat_arrays(found))


def handed_delta(inputs: SampleInputs, mapping: TableRef, touched: pa.Array
                 ) -> tuple[Delta, Counter]:
    """The delta of the touched ids (their plan rows against their rows in `mapping`;
    every other sample is unchanged and reused) and the source's rows left out, counted."""
    plan, _ = plan_samples(inputs, touched)
    mapping = mapping.latest()
    delta = plan_delta(plan, rows_with_ids(mapping.open(), touched, APPEND_COLUMNS))
    delta.reused = mapping.count_rows() - delta.stale.num_rows
    kept = inputs.bucketed.open().count_rows(filter=KEPT)
    live = delta.reused + delta.write.num_rows
    return delta, +Counter(no_caption=kept - live)
