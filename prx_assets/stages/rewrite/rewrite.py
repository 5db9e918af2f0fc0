"""Rewriting one source's MDS tree without its skipped samples.

Skip lists are free to change but cost I/O at training time (skipped samples are still
stored and listed); past ~10 % skipped in a stream a rewrite pays off. The rewrite builds a
new tree with the shard writer from the same pinned inputs as the current tree, minus the
skipped ids, and swaps it in atomically. Reasons not rewritten (e.g. ablation lists one
wants to keep toggling) are carried over as sidecars of the new tree, so the loader yields
exactly the same ids before and after.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from prx_assets.stages.shards.mds import write_mds_tree
from prx_assets.stages.shards.plan import SampleInputs, WriteOptions
from prx_assets.stages.shards.publish import TreeReport
from prx_assets.stages.skip_lists.skip_lists import (
    MAPPING_COLUMNS,
    SCAN_ROWS,
    ApplyReport,
    applies_by_default,
    build_skip_lists,
    reasons_in,
    skipped_ids,
    stage_sidecars,
)
from prx_assets.storage.layout import Storage, as_storage
from prx_assets.storage.refs import Location, TableRef
from prx_assets.storage.sidecars import REASON_STALE
from prx_assets.storage.tables import BUCKETED_IMAGES, CAPTIONS, MDS_SAMPLES, RAW_IMAGES
from prx_assets.storage.trees import tree_store

logger = logging.getLogger(__name__)


@dataclass
class RewriteReport:
    tree: TreeReport
    excluded: int
    rewritten_reasons: list[str]
    carried_over: ApplyReport


def pinned_inputs(storage: Storage | str | Path, source: str, caption_filter: str) -> SampleInputs:
    """The inputs of the current tree, at the Lance versions it was built from."""
    storage = as_storage(storage)
    store = tree_store(storage, source)
    current = store.current_version()
    manifest = store.manifest(current) if current else None
    if manifest is None:
        raise FileNotFoundError(f"no MDS tree for source {source!r} under {storage.mds_root}; "
                                "materialise mds_shards first")
    return SampleInputs(
        bucketed=storage.table(BUCKETED_IMAGES, source).at(manifest.get("bucketed_version")),
        captions=storage.table(CAPTIONS, source).at(manifest.get("captions_version")),
        caption_filter=caption_filter,
        license=(manifest.get("settings") or {}).get("license", "unknown"),
        raw=_existing(storage.table(RAW_IMAGES, source)))


def _existing(table: TableRef) -> TableRef | None:
    return table.pinned() if table.exists() else None


def _ids(table: TableRef, condition: str | None = None) -> pa.Array:
    """The ids as one Arrow array (a few dozen bytes a row, no Python string per row)."""
    ids = table.to_table(columns=["id"], filter=condition).column("id")
    return ids.combine_chunks() if ids.num_chunks else pa.array([], pa.string())


def _without(ids: pa.Array, dropped: pa.Array) -> pa.Array:
    return ids.filter(pc.invert(pc.is_in(ids, value_set=dropped)))


def _planned_not_kept(inputs: SampleInputs, kept: pa.Array, batch_rows: int = SCAN_ROWS
                      ) -> list[pa.Array]:
    """Ids the inputs plan (kept bucketed rows) that `kept` lacks, streamed (what earlier
    rewrites or the build's own rules left out)."""
    scanner = inputs.bucketed.open().scanner(columns=["id"], filter="status = 'ok'",
                                             batch_size=batch_rows)
    return [_without(batch.column("id"), kept) for batch in scanner.to_batches()]


def _exclusions(parts: list[pa.Array]) -> pa.Array:
    """One value set of the ids a build leaves out."""
    return pc.unique(pa.concat_arrays([pa.array([], pa.string()), *parts]))


def rewrite_without_skipped(inputs: SampleInputs, storage: Storage | str | Path, source: str,
                            reasons: Iterable[str] | None = None,
                            options: WriteOptions | None = None,
                            log: Callable[[str], None] = logger.info) -> RewriteReport:
    """Rebuild `source`'s tree without the samples skipped for `reasons` (by default the
    reasons the loader applies by default: the opt-in `balance` and ablation lists stay skip
    lists of the new tree, so a run that does not name them still reads their samples).
    Stale samples (superseded by an incremental run) are never in the mapping table, so the
    rewrite leaves them out whatever `reasons` says."""
    storage = as_storage(storage)
    inputs = inputs.pinned()  # the ids planned here and the build read one version
    old_tree = tree_store(storage, source).current_tree()
    mapping = storage.table(MDS_SAMPLES, source)
    present = reasons_in(old_tree) - {REASON_STALE}
    rewritten = sorted({r for r in present if applies_by_default(r)} if reasons is None
                       else set(reasons) & present)
    excluded = skipped_ids(old_tree, mapping, rewritten)
    kept_lists = {r: _without(skipped_ids(old_tree, mapping, [r]), excluded)
                  for r in sorted(present - set(rewritten))}
    log(f"{source}: rewriting without {len(excluded):,} skipped samples "
        f"({', '.join(rewritten) or 'no reason'}); carrying over {', '.join(kept_lists) or 'none'}")
    # The new tree is a subset of the current one: what earlier rewrites (or the current
    # build's own rules) left out stays out.
    kept = _without(_ids(mapping), excluded)
    inputs = dataclasses.replace(inputs, exclude_ids=_exclusions(
        [inputs.exclude_ids, *_planned_not_kept(inputs, kept)]))
    del kept
    carried = ApplyReport()

    def stage_kept_lists(staging: Location, mapping: pa.Table) -> None:
        # The reasons not rewritten, as sidecars of the new version before it publishes: a
        # reader of the new tree never sees its shards without them. Called per group.
        carried.add(stage_sidecars(staging, build_skip_lists(
            mapping.select(MAPPING_COLUMNS).to_batches(),
            {r: ids for r, ids in kept_lists.items() if len(ids)})))

    report = write_mds_tree(inputs, storage, source,
                            dataclasses.replace(options or WriteOptions(), incremental=False),
                            log, stage_files=stage_kept_lists)
    return RewriteReport(tree=report, excluded=len(excluded), rewritten_reasons=rewritten,
                         carried_over=carried)
