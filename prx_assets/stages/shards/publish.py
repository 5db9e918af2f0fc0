"""A build's commits, in order: the version staged and made complete (its manifest last),
the mapping table committed, the version published, old versions pruned; and the roll
forward of a run killed between its mapping commit and its publish (docs/mds.md)."""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from prx_assets.stages.shards.card import write_source_card
from prx_assets.stages.shards.groups import write_groups
from prx_assets.stages.shards.handed import consumed_inputs
from prx_assets.stages.shards.mapping import (
    MAPPED_LEAVES,
    commit_fragments,
    mapped_leaves,
    update_mapping,
)
from prx_assets.stages.shards.merge import (
    LeafEntries,
    StaleCounts,
    carry_old_leaves,
    write_new_leaves,
)
from prx_assets.stages.shards.plan import Build, Delta
from prx_assets.storage.failpoints import failpoint
from prx_assets.storage.key_index import KeyIndexPolicy, refresh_key_index
from prx_assets.storage.lance_tables import FragmentPolicy, cleanup, compact, small_fragments
from prx_assets.storage.refs import Location, TableRef
from prx_assets.storage.trees import (
    DEFAULT_RETENTION,
    TREE_MANIFEST,
    TreeStore,
    leaf_key,
    leaf_name,
    leaf_names,
    lineage,
    read_index,
)

logger = logging.getLogger(__name__)
# Fragments of a mapping under half a full one's rows before a publish compacts them: each
# incremental run adds one; compacting every run would remap the whole index every run.
MAPPING_SMALL_FRAGMENTS = 16


@dataclass(frozen=True)
class LeafReport:
    tier: int
    width: int
    height: int
    samples: int  # live samples (stored minus stale)
    shards: int
    bytes: int

    @property
    def name(self) -> str:
        return leaf_name(self.tier, self.width, self.height)


@dataclass
class TreeReport:
    source: str
    tree_version: str
    path: Path | str  # a local folder, or the version's s3:// prefix
    mapping: TableRef  # the mapping table at the version that describes this tree
    left_out: Counter = field(default_factory=Counter)
    leaves: list[LeafReport] = field(default_factory=list)
    processed: int = 0  # samples written by this run
    reused: int = 0  # live samples carried in old shards
    removed: int = 0  # samples newly skipped as stale (or, in a full build, gone)
    changed: bool = True  # False: nothing changed, no new version was made
    appended: bool = False  # True: old shards carried, new shards appended
    compared_ids: int | None = None  # ids handed by the inputs' changes; None: every id

    @property
    def mapping_version(self) -> int:
        assert self.mapping.version is not None  # reports name a committed version
        return self.mapping.version

    @property
    def samples(self) -> int:
        return sum(leaf.samples for leaf in self.leaves)

    @property
    def shards(self) -> int:
        return sum(leaf.shards for leaf in self.leaves)

    @property
    def bytes(self) -> int:
        return sum(leaf.bytes for leaf in self.leaves)


@dataclass(frozen=True)
class Counts:
    """What a build did, for its report and the asset's incremental metadata."""

    processed: int
    reused: int
    removed: int
    appended: bool


@contextmanager
def staged(build: Build) -> Iterator[None]:
    """The build's version staged; deleted if anything fails or kills the run before the
    version is finished (an empty source still gets an empty tree)."""
    try:
        build.staging.make_dirs()
        yield
    except BaseException:
        build.staging.delete()
        raise


def grouped_full_build(build: Build) -> TreeReport:
    """A full build planned in groups of leaves (`groups`): the driver holds one group's
    plan at a time; the mapping is committed in one Overwrite of the staged fragments."""
    with staged(build):
        done = write_groups(build)
        leaves = leaf_reports({}, {}, done.written)
        write_manifest(build, carried=[], samples=done.samples)
        final = build.store.finish(build.version)
    check_base(build)
    failpoint("mds.before_mapping_commit")
    mapping_version = commit_fragments(build.mapping, done.fragments)
    return publish(build, final, mapping_version, done.left_out, leaves,
                   Counts(processed=done.samples, reused=0, removed=done.removed,
                          appended=False))


def append_build(build: Build, delta: Delta, left_out: Counter, current: str) -> TreeReport:
    store = build.store
    build.log(f"{build.source}: appending {delta.write.num_rows:,} samples to tree {current}; "
              f"{delta.stale.num_rows:,} become stale, {delta.reused:,} carried")
    old_manifest = store.manifest(current) or {}
    with staged(build):
        existing, stale_per_shard = carry_old_leaves(store, store.tree(current), build.staging,
                                                     delta.stale)
        written, mapping = write_new_leaves(build, delta.write, existing)
        leaves = leaf_reports(existing, stale_per_shard, written)
        if build.stage_files is not None:
            build.stage_files(build.staging, mapping)
        write_manifest(build, carried=lineage(old_manifest, current),
                       samples=sum(leaf.samples for leaf in leaves), parent=current)
        final = store.finish(build.version)
    check_base(build)
    mapping_version = update_mapping(build.mapping, mapping, delta.removed_ids)
    return publish(build, final, mapping_version, left_out, leaves,
                   Counts(processed=delta.write.num_rows, reused=delta.reused,
                          removed=delta.stale.num_rows, appended=True))


def check_base(build: Build) -> None:
    """Before the mapping commit: this run still holds the tree lease and the pointer still
    names the tree it planned against (the publish compares again, atomically)."""
    build.check_lease()
    named = build.store.current_version()
    if named != build.base_tree:
        raise build.store.conflict(build.version, build.base_tree, named)


def leaf_reports(existing: LeafEntries, stale: StaleCounts, written: LeafEntries
                 ) -> list[LeafReport]:
    reports = []
    for name in sorted(set(existing) | set(written), key=leaf_key):
        entries = [*existing.get(name, []), *written.get(name, [])]
        stored = sum(e["samples"] for e in entries)
        stale_n = sum(stale.get((name, e["raw_data"]["basename"]), 0) for e in entries)
        reports.append(LeafReport(*leaf_key(name), samples=stored - stale_n,
                                  shards=len(entries), bytes=_bytes(entries)))
    return reports


def _bytes(entries: list[dict]) -> int:
    return sum(entry["raw_data"]["bytes"] for entry in entries)


def write_manifest(build: Build, *, carried: list[str], samples: int,
                   parent: str | None = None) -> None:
    """tree.json, last inside the version: complete means it exists. `carried_versions`
    names the older versions whose shards this one also holds (with this version: the
    mapping's tree_version values; see `lineage`);
    `mapping_base_version` lets a later run tell whether this build's mapping commit
    happened before a kill (see finish_interrupted_publish); `consumed`, which rows of the
    inputs the next run is handed as changes (`handed`). The tree's card goes in first."""
    write_source_card(build)
    (build.staging / TREE_MANIFEST).write_text(json.dumps({
        "source": build.source, "tree_version": build.version, "samples": samples,
        "bucketed_version": build.inputs.bucketed.version,
        "captions_version": build.inputs.captions.version,
        "settings": build.settings, "carried_versions": carried, "parent": parent,
        "commits_mapping": True, "mapping_base_version": build.base_version,
        "retention_s": build.options.retention.total_seconds(),
        "consumed": consumed_inputs(build.inputs),
    }, indent=2, sort_keys=True))


def publish(build: Build, final: Location, mapping_version: int, left_out: Counter,
            leaves: list[LeafReport], counts: Counts) -> TreeReport:
    failpoint("mds.before_publish")
    build.check_lease()
    build.store.publish(build.version, expected=build.base_tree)
    if maintain_mapping(build.mapping, build.options.mapping_index):
        mapping_version = build.mapping.latest_version() or mapping_version
    prune(build.store, build.options.retention, build.log)
    build.log(f"{build.source}: tree {build.version} is current "
              f"({sum(leaf.samples for leaf in leaves):,} live samples, "
              f"{sum(leaf.shards for leaf in leaves)} shards; processed={counts.processed}, "
              f"reused={counts.reused}, removed={counts.removed}, appended={counts.appended})")
    return TreeReport(source=build.source, tree_version=build.version, path=report_path(final),
                      mapping=build.mapping.at(mapping_version), left_out=left_out,
                      leaves=leaves, processed=counts.processed, reused=counts.reused,
                      removed=counts.removed, appended=counts.appended)


def prune(store: TreeStore, retention: timedelta, log: Callable[[str], None]) -> None:
    """Retention after a publish: superseded trees past it that no reader holds go."""
    removed = store.prune(retention)
    if removed:
        log(f"{store.source}: removed {len(removed)} tree(s) past retention that no reader "
            f"holds: {', '.join(removed)}")


def maintain_mapping(mapping: TableRef, index: KeyIndexPolicy) -> bool:
    """The mapping kept fit for months of runs, once its tree is current (so the mapping
    commit stays the last commit before the publish, as a roll forward checks): its key
    index brought up to date; its small fragments (one per incremental run) compacted
    once there are `MAPPING_SMALL_FRAGMENTS`, not every run (a compaction remaps the whole
    index); versions past the metadata retention and the files of killed builds' staged
    fragments (a week old) freed. True if this made a version."""
    policy = FragmentPolicy(key_index=index)
    made = bool(refresh_key_index(mapping, "id", index))
    if small_fragments(mapping.latest().open(), policy) >= MAPPING_SMALL_FRAGMENTS:
        compact(mapping, policy)
        made = True
    cleanup(mapping.latest().open(), policy)
    return made


def report_path(tree: Location) -> Path | str:
    """A tree as reports give it: a local folder, or its `s3://` prefix."""
    return tree.path if tree.is_local else tree.uri


def unchanged_report(build: Build, current: str, left_out: Counter) -> TreeReport:
    tree = build.store.tree(current)
    mapping = build.mapping.pinned()
    live, _ = mapped_leaves(mapping, cache=build.store.trees_dir / MAPPED_LEAVES)
    leaves = []
    for name in leaf_names(tree):
        entries = read_index(tree / name)
        leaves.append(LeafReport(*leaf_key(name), samples=live.get(name, 0),
                                 shards=len(entries), bytes=_bytes(entries)))
    return TreeReport(source=build.source, tree_version=current, path=report_path(tree),
                      mapping=mapping, left_out=left_out, leaves=leaves,
                      processed=0, reused=sum(live.values()), removed=0, changed=False)


def finish_interrupted_publish(store: TreeStore, mapping: TableRef,
                               log: Callable[[str], None] = logger.info) -> None:
    """A run killed after its mapping commit but before publishing left a complete version
    the mapping already describes: publish it and apply the retention it was built with, as
    its own publish would have (roll forward: else the tree it supersedes outlives its
    retention until some later build publishes). Any other unpublished version (killed
    before its mapping commit) is deleted."""
    current = store.current_version()
    newer = [v for v in store.versions() if current is None or v > current]
    keep: frozenset[str] = frozenset()
    if newer:
        manifest = store.manifest(newer[-1]) or {}
        expected = (manifest.get("mapping_base_version") or 0) + 1
        if manifest.get("commits_mapping") and mapping.latest_version() == expected:
            log(f"{store.source}: tree {newer[-1]} was built and mapped but not published "
                "(a killed run); publishing it now")
            store.publish(newer[-1], expected=current)
            keep = frozenset({newer[-1]})
            retention = manifest.get("retention_s")
            prune(store, DEFAULT_RETENTION if retention is None
                  else timedelta(seconds=float(retention)), log)
    store.remove_unpublished(keep)


def mapping_ahead(store: TreeStore, mapping: TableRef) -> list[str]:
    """Tree versions the mapping names that the current tree does not hold: a run whose
    lease lapsed after its mapping commit, whose version the writer that took over had
    already removed as unpublished, left the mapping describing a tree that will never be
    published (no roll forward can fix it: the next run builds in full). Counted per
    fragment with the cache `verify` keeps."""
    current = store.current_version()
    if current is None or not mapping.exists():
        return []
    held = set(lineage(store.manifest(current) or {}, current))
    _, named = mapped_leaves(mapping, cache=store.trees_dir / MAPPED_LEAVES)
    return sorted(named - held)
