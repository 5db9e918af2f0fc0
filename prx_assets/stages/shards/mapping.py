"""The mapping table `lance/mds_samples/<source>.lance`: where every live sample of the
current tree is stored (leaf, shard, shard-local index), with the tree version that wrote
the shard and the sample's fingerprint. One row per live id; stale samples are not in it."""

from __future__ import annotations

import json
from collections import Counter
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prx_assets.storage.filters import in_filter
from prx_assets.storage.refs import Location, TableRef
from prx_assets.storage.trees import leaf_name

if TYPE_CHECKING:
    import lance
    from lance.fragment import FragmentMetadata

MDS_SAMPLES_SCHEMA = pa.schema([
    pa.field("id", pa.string(), nullable=False),
    pa.field("source", pa.string(), nullable=False),
    pa.field("tier", pa.int32(), nullable=False),
    pa.field("width", pa.int32(), nullable=False),
    pa.field("height", pa.int32(), nullable=False),
    pa.field("leaf", pa.string(), nullable=False),  # relative to mds/<source>, e.g. 512/512x512
    pa.field("shard", pa.string(), nullable=False),  # e.g. shard.00000.mds
    pa.field("sample_index", pa.int64(), nullable=False),  # shard-local
    pa.field("tree_version", pa.string(), nullable=False),  # the version that wrote the shard
    pa.field("fingerprint", pa.int64(), nullable=False),  # see plan.sample_fingerprints
])
SCAN_ROWS = 1 << 18  # rows per batch of a streamed pass over the mapping
# What an incremental run compares the plan with, and where a stale sample is stored.
APPEND_COLUMNS = ["id", "fingerprint", "leaf", "shard", "sample_index"]
MAPPED_LEAVES = "mapped_leaves.json"  # per-fragment counts, in the source's trees folder


def mapping_rows(source: str, key: tuple[int, int, int], leaf_rows: pa.Table,
                 shards: list[dict], tree_version: str) -> pa.Table:
    """Mapping rows of `leaf_rows`, written (in order) as the shards `shards`."""
    counts = [entry["samples"] for entry in shards]
    if sum(counts) != leaf_rows.num_rows:
        raise RuntimeError(f"{leaf_name(*key)}: shards hold {sum(counts)} samples, "
                           f"planned {leaf_rows.num_rows}")
    n = leaf_rows.num_rows
    # Arrow all through (a full build maps every sample of the source): a shard's name is
    # taken per row from the shard list, constants are repeated scalars.
    basenames = pa.array([entry["raw_data"]["basename"] for entry in shards], pa.string())
    names = basenames.take(np.repeat(np.arange(len(counts), dtype=np.int64), counts))
    local = (np.concatenate([np.arange(c, dtype=np.int64) for c in counts]) if counts
             else np.zeros(0, np.int64))
    tier, width, height = key
    return pa.table({
        "id": leaf_rows["id"],
        "source": _repeated(source, n),
        "tier": pa.array(np.full(n, tier), pa.int32()),
        "width": pa.array(np.full(n, width), pa.int32()),
        "height": pa.array(np.full(n, height), pa.int32()),
        "leaf": _repeated(leaf_name(*key), n),
        "shard": names,
        "sample_index": pa.array(local, pa.int64()),
        "tree_version": _repeated(tree_version, n),
        "fingerprint": leaf_rows["fingerprint"],
    }, schema=MDS_SAMPLES_SCHEMA)


def _repeated(value: str, n: int) -> pa.Array:
    return pa.repeat(pa.scalar(value, pa.string()), n)


def mapping_comparable(mapping: TableRef) -> bool:
    """Whether an incremental run can compare its plan with the mapping: False when there
    is none (never written) or it is of a layout without fingerprints."""
    return mapping.exists() and "fingerprint" in mapping.latest().open().schema.names


def mapping_for_append(mapping: TableRef) -> pa.Table | None:
    """The mapping's rows a whole-source comparison reads (the baseline of
    `bench.plan_growth`), or None when it is not `mapping_comparable`."""
    if not mapping_comparable(mapping):
        return None
    return mapping.latest().to_table(columns=APPEND_COLUMNS)


def mapped_leaves(mapping: TableRef, batch_rows: int = SCAN_ROWS,
                  cache: Location | None = None) -> tuple[Counter, set[str]]:
    """Live samples per leaf and the tree versions the mapping names, counted in Arrow per
    fragment (one entry per leaf and per version, never one per row). With `cache` (a JSON
    file), the counts of fragments an earlier call counted are reused: a run that changed
    a few samples scans the fragments it wrote or deleted from, not the whole mapping."""
    table = mapping.open()
    known = read_fragment_counts(cache)
    counted: dict[str, dict[str, dict[str, int]]] = {}
    per_leaf: Counter = Counter()
    versions: Counter = Counter()
    for fragment in table.get_fragments():
        key = fragment_key(fragment)
        counts = known.get(key) or count_fragment(table, fragment, batch_rows)
        counted[key] = counts
        per_leaf.update(counts["leaves"])
        versions.update(counts["versions"])
    if cache is not None and counted.keys() != known.keys():
        cache.write_text(json.dumps({"fragments": counted}, sort_keys=True))
    return per_leaf, set(versions)


def fragment_key(fragment: lance.LanceFragment) -> str:
    """What fixes a fragment's live rows: its data file (a unique name, never rewritten)
    and its deletion file (a new one for every delete; None: no deletions)."""
    deletions = fragment.metadata.deletion_file
    suffix = "" if deletions is None else f"|{deletions.read_version}.{deletions.id}"
    return fragment.metadata.files[0].path + suffix


def count_fragment(table: lance.LanceDataset, fragment: lance.LanceFragment,
                   batch_rows: int) -> dict[str, dict[str, int]]:
    """The live rows of one fragment per leaf and per tree version, by one streamed scan."""
    leaves: Counter = Counter()
    versions: Counter = Counter()
    for batch in table.scanner(columns=["leaf", "tree_version"], fragments=[fragment],
                               batch_size=batch_rows).to_batches():
        for column, counter in (("leaf", leaves), ("tree_version", versions)):
            for pair in pc.value_counts(batch.column(column)).to_pylist():
                counter[pair["values"]] += pair["counts"]
    return {"leaves": dict(leaves), "versions": dict(versions)}


def read_fragment_counts(cache: Location | None) -> dict[str, dict[str, dict[str, int]]]:
    """Counts per fragment key from an earlier call; nothing when absent or unreadable
    (every fragment is counted again). Two runs writing it at once is harmless: each
    writes whole (`Location.write_text`) counts true of the fragments they name."""
    if cache is None:
        return {}
    try:
        fragments = json.loads(cache.read_text())["fragments"]
        return {str(key): {part: {str(k): int(v) for k, v in counts[part].items()}
                           for part in ("leaves", "versions")}
                for key, counts in fragments.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def update_mapping(mapping: TableRef, new_rows: pa.Table, removed_ids: list[str]) -> int:
    """One commit: rows of newly written samples in (a changed id's row replaced), rows of
    removed ids out; every other row untouched."""
    dataset = mapping.latest().open()
    gone = in_filter("id", removed_ids) if removed_ids else None
    if new_rows.num_rows == 0:
        dataset.delete(gone)
    else:
        merge = dataset.merge_insert("id").when_matched_update_all() \
            .when_not_matched_insert_all()
        if gone:
            merge = merge.when_not_matched_by_source_delete(gone)
        merge.execute(new_rows)
    return mapping.latest().open().version


def stage_fragments(mapping: TableRef, rows: pa.Table) -> list[FragmentMetadata]:
    """`rows` written as mapping fragments that no version references yet."""
    # Imported here: storage.replace brings in Ray, and the tree check's spawned child
    # imports this module (through verify) for the mapping's counts alone.
    from prx_assets.storage.replace import write_uncommitted

    if rows.num_rows == 0:
        return []
    return write_uncommitted(mapping, [rows], MDS_SAMPLES_SCHEMA, whole=True)[0]


def commit_fragments(mapping: TableRef, fragments: list[FragmentMetadata]) -> int:
    """The staged fragments as the mapping's whole new version, in one commit: readers see
    the previous mapping or this one, never a mix."""
    from prx_assets.storage.replace import overwrite_with

    return overwrite_with(mapping, MDS_SAMPLES_SCHEMA, fragments)
