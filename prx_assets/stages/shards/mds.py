"""Mosaic Data Shards: the per-source tree the trainer streams, written from Lance.

Layout (see docs/mds.md and `trees.py`):

    $PRX_DATA_ROOT/mds/<source>                -> .trees/<source>/<tree_version>  (symlink)
    $PRX_DATA_ROOT/mds/<source>.current.json   names the current version (s3:// roots)
    $PRX_DATA_ROOT/mds/.trees/<source>/<tree_version>/<tier>/<W>x<H>/index.json + shard.NNNNN.mds

Every run makes a new tree version aside and publishes it last (symlink replaced, or the
pointer object PUT), so a reader sees one whole tree; a killed run leaves the previous tree
current. The mapping table `lance/mds_samples/<source>.lance` says where every live id of
the current tree is stored.

Incremental by default: the pinned inputs are compared with the mapping table by id and a
fingerprint of cheap columns (`plan.sample_fingerprints`). New and changed samples are
written as new shards appended to their leaves; the new version's index lists the old
shards unchanged (hard-linked locally, server-side copied on S3) plus the new ones,
numbering continuing. Removed samples and the old copies of changed ones stay in their
shards, skipped through the sidecars under the reason `stale` until a rewrite. Nothing
changed: no new version at all. A change of the settings (size limit, compression, caption
filter) or no usable previous tree means a full build.

The steps, one module each: `plan` (what to write, from metadata only), `parts` (Ray tasks
writing parts with `MDSWriter`), `merge` (parts into one shard sequence per leaf, old shards
carried), `mapping` (the mapping table), `groups` (full builds and full compares in groups
of leaves), `handed` (an incremental run handed its inputs' changes), `publish` (the
commits, in order), `verify` (the `leaves_stream` check). Same inputs, same options:
byte-identical shards.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from prx_assets.stages.shards.groups import compare_groups
from prx_assets.stages.shards.handed import (
    consumed_record,
    handed_delta,
    record_unchanged,
    touched_ids,
)
from prx_assets.stages.shards.mapping import mapping_comparable
from prx_assets.stages.shards.plan import (
    Build,
    Delta,
    SampleInputs,
    StageFiles,
    WriteOptions,
)
from prx_assets.stages.shards.publish import (
    TreeReport,
    append_build,
    finish_interrupted_publish,
    grouped_full_build,
    mapping_ahead,
    unchanged_report,
)
from prx_assets.storage.lance_tables import prepare_output_dir
from prx_assets.storage.layout import Storage, as_storage
from prx_assets.storage.leases import Lease, tree_lease
from prx_assets.storage.tables import MDS_SAMPLES
from prx_assets.storage.trees import TreeStore, tree_store

logger = logging.getLogger(__name__)


def write_mds_tree(inputs: SampleInputs, storage: Storage | str | Path, source: str,
                   options: WriteOptions | None = None,
                   log: Callable[[str], None] = logger.info,
                   stage_files: StageFiles | None = None) -> TreeReport:
    """Make `source`'s tree match `inputs`: append what changed to a new version (or build
    one in full), commit the mapping table, then publish the version (in that order, see
    docs/mds.md for what a kill between the steps leaves and how the next run finishes it).
    Holds the source's tree lease throughout (docs/factory.md): one tree writer at a time.
    `options`: the defaults of `WriteOptions` when None; `stage_files`: see `StageFiles`."""
    storage = as_storage(storage)
    store = tree_store(storage, source, log)
    store.prepare()
    with tree_lease(store.data_root, source, log=log) as lease:
        return _write(inputs, storage, store, options or WriteOptions(), lease, stage_files)


def _write(inputs: SampleInputs, storage: Storage, store: TreeStore, options: WriteOptions,
           lease: Lease, stage_files: StageFiles | None) -> TreeReport:
    source, log = store.source, store.log
    mapping = storage.table(MDS_SAMPLES, source)
    prepare_output_dir(mapping, "Lance table")
    finish_interrupted_publish(store, mapping, log)
    ahead = mapping_ahead(store, mapping)
    if ahead:
        log(f"{source}: the mapping names tree(s) {', '.join(ahead)} that were never "
            "published (a run lost its lease after its mapping commit): building in full")
    current = store.current_version()
    build = Build(store, mapping, inputs.pinned(), options, mapping.latest_version(),
                  base_tree=current, lease=lease, stage_files=stage_files)
    manifest = None if ahead else _manifest_to_append_to(build, current)
    touched = None if manifest is None or current is None else touched_ids(
        build.inputs, consumed_record(store.trees_dir, current, manifest))
    if current is not None and touched is not None and mapping.exists():
        log(f"{source}: {len(touched):,} ids written to or deleted from the inputs since "
            f"tree {current}: comparing those")
        delta, left_out = handed_delta(build.inputs, mapping, touched)
        return _append_or_unchanged(build, delta, left_out, current, compared=len(touched))
    if current is None or manifest is None or not mapping_comparable(mapping):
        return grouped_full_build(build)
    delta, left_out = compare_groups(build)
    return _append_or_unchanged(build, delta, left_out, current, compared=None)


def _append_or_unchanged(build: Build, delta: Delta, left_out: Counter, current: str,
                         compared: int | None) -> TreeReport:
    if delta.empty:
        build.log(f"{build.source}: nothing changed since tree {current}; no new version")
        report = unchanged_report(build, current, left_out)
        record_unchanged(build.store.trees_dir, current, build.inputs)
    else:
        report = append_build(build, delta, left_out, current)
    report.compared_ids = compared
    return report


def _manifest_to_append_to(build: Build, current: str | None) -> dict | None:
    """The current tree's manifest when this run may append to it, or None when it must
    build in full: first run, `incremental=False`, or other settings."""
    if not build.options.incremental or current is None:
        return None
    manifest = build.store.manifest(current) or {}
    if manifest.get("settings") != json.loads(json.dumps(build.settings)):
        build.log(f"{build.source}: settings differ from tree {current}'s: full build")
        return None
    return manifest
