"""Filling a staged tree version: the parts' shards renamed into one `shard.NNNNN.mds`
sequence per leaf with the leaf's index, and (incremental) the current tree's shards and
sidecars carried in unchanged, newly stale samples added to their sidecars."""

from __future__ import annotations

import json

import pyarrow as pa

from prx_assets.stages.shards.mapping import MDS_SAMPLES_SCHEMA, mapping_rows
from prx_assets.stages.shards.parts import PartSpec, part_specs, run_parts
from prx_assets.stages.shards.plan import Build, split_leaves
from prx_assets.storage.refs import Location
from prx_assets.storage.sidecars import (
    REASON_STALE,
    SIDECAR_SUFFIX,
    read_sidecar,
    sidecar_name,
    write_sidecar,
)
from prx_assets.storage.trees import (
    INDEX,
    TreeStore,
    check_shards,
    leaf_name,
    leaf_names,
    read_index,
)

LeafEntries = dict[str, list[dict]]  # index entries per leaf name
StaleCounts = dict[tuple[str, str], int]  # stale samples per (leaf, shard)


def write_index(leaf_dir: Location, shards: list[dict]) -> None:
    """The leaf's index, written only once every shard it lists is present and whole; in a
    staged version, flushed to disk with the others when the version is finished
    (`TreeStore.finish`), not one by one."""
    check_shards(leaf_dir, shards)
    (leaf_dir / INDEX).write_text(json.dumps({"version": 2, "shards": shards}, sort_keys=True),
                                  durable=False)


def merge_leaf(store: TreeStore, leaf_dir: Location, parts: list[tuple[PartSpec, list[dict]]],
               existing: list[dict] | None = None) -> list[dict]:
    """Move every part's shards into `leaf_dir` as one sequence, numbered after the
    `existing` entries (carried shards of an appended leaf), and write the leaf's index.

    (streaming's `merge_index` keeps each part in its own subfolder; renaming keeps the flat
    `shard.NNNNN.mds` layout that skip-list sidecars sit beside.)"""
    shards: list[dict] = list(existing or [])
    for spec, entries in parts:
        for entry in entries:
            number = len(shards)
            entry = json.loads(json.dumps(entry))  # a private copy to rename in
            for kind in ("raw_data", "zip_data"):
                info = entry.get(kind)
                if info:
                    old = spec.out / info["basename"]
                    suffix = info["basename"].split(".mds", 1)[1]  # "" or a compression's
                    info["basename"] = f"shard.{number:05d}.mds{suffix}"
                    store.move(old, leaf_dir / info["basename"])  # absent: fails, by name
            shards.append(entry)
        spec.out.delete()
    write_index(leaf_dir, shards)
    return shards


def write_new_leaves(build: Build, plan: pa.Table, existing: LeafEntries
                     ) -> tuple[LeafEntries, pa.Table]:
    """Write `plan`'s samples as new shards, appended to `existing` leaves or in new ones;
    returns the new shard entries per leaf and their mapping rows."""
    leaves = split_leaves(plan)
    specs_per_leaf = [part_specs(rows, build.staging / leaf_name(*key),
                                 build.options.rows_per_part) for key, rows in leaves]
    flat = [spec for specs in specs_per_leaf for spec in specs]
    build.log(f"{build.source}: {len(leaves)} leaves to write, {len(flat)} parts")
    results = iter(run_parts(flat, build.inputs, build.options, build.log,
                             stage=f"mds_shards[{build.source}]"))
    written: LeafEntries = {}
    tables = []
    for (key, rows), specs in zip(leaves, specs_per_leaf, strict=True):
        name = leaf_name(*key)
        before = existing.get(name, [])
        leaf_dir = build.staging / name
        leaf_dir.make_dirs()
        shards = merge_leaf(build.store, leaf_dir, [(spec, next(results)) for spec in specs],
                            before)
        written[name] = shards[len(before):]
        tables.append(mapping_rows(build.source, key, rows, written[name], build.version))
    mapping = pa.concat_tables(tables) if tables else MDS_SAMPLES_SCHEMA.empty_table()
    return written, mapping


def carry_old_leaves(store: TreeStore, old_tree: Location, staging: Location, stale: pa.Table
                     ) -> tuple[LeafEntries, StaleCounts]:
    """Every shard of the current tree into the new version (linked or server-side copied,
    never rewritten), each sidecar with the newly stale indices added; returns each leaf's
    index entries and each shard's stale count (all stale, old and new)."""
    newly: dict[tuple[str, str], list[int]] = {}
    for leaf, shard, index in zip(stale["leaf"].to_pylist(), stale["shard"].to_pylist(),
                                  stale["sample_index"].to_pylist(), strict=True):
        newly.setdefault((leaf, shard), []).append(int(index))
    existing: LeafEntries = {}
    stale_counts: StaleCounts = {}
    carried: list[tuple[Location, Location]] = []
    for leaf in leaf_names(old_tree):
        old_leaf, new_leaf = old_tree / leaf, staging / leaf
        entries = read_index(old_leaf)
        existing[leaf] = entries
        new_leaf.make_dirs()
        sidecars = {file.name for file in old_leaf.files(SIDECAR_SUFFIX)}
        for entry in entries:
            for kind in ("raw_data", "zip_data"):
                if entry.get(kind):
                    name = entry[kind]["basename"]
                    carried.append((old_leaf / name, new_leaf / name))
            shard = entry["raw_data"]["basename"]
            sidecar = sidecar_name(shard)
            lists = read_sidecar(old_leaf / sidecar) if sidecar in sidecars else {}
            added = newly.pop((leaf, shard), [])
            if added:
                lists[REASON_STALE] = sorted(set(lists.get(REASON_STALE, [])) | set(added))
                write_sidecar(new_leaf / sidecar, lists)
            elif sidecar in sidecars:
                carried.append((old_leaf / sidecar, new_leaf / sidecar))
            stale_counts[(leaf, shard)] = len(lists.get(REASON_STALE, []))
    if newly:
        raise RuntimeError(f"mapping rows name shards the current tree lacks: {sorted(newly)[:3]}")
    store.carry_many(carried)
    for leaf, entries in existing.items():  # indexed once its carried shards are in place
        write_index(staging / leaf, entries)
    return existing, stale_counts
