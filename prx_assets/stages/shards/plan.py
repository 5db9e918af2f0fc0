"""Planning a build from metadata only: which samples a tree holds (kept rows of
`bucketed_images` with a usable caption), their fingerprints, and what an incremental run
changes against the mapping table. No image bytes, no caption text."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prx_assets.storage.changes import rows_with_ids, scan_rows_with_ids
from prx_assets.storage.key_index import KeyIndexPolicy
from prx_assets.storage.leases import Lease
from prx_assets.storage.refs import Location, TableRef
from prx_assets.storage.trees import DEFAULT_RETENTION, TreeStore, new_tree_version

# Files a caller adds to a staged version before its manifest (so they publish with it):
# called with the staging folder and the mapping rows of the samples this build wrote, once
# per group of a grouped build (each shard's rows come in one call). The rewrite's carried
# sidecars use it; a tree card belongs here too.
StageFiles = Callable[[Location, pa.Table], None]

# The design's MDS sample. `image` is declared `jpeg` so any StreamingDataset decodes it to a
# PIL image, but we hand MDSWriter the bytes: `mds_encode` stores bytes as they are, so the
# pipeline's Q92 JPEG is never re-encoded (the `jpeg` encoder would save a PIL image at Q75).
MDS_COLUMNS = {
    "image": "jpeg",
    "caption": "str",
    "id": "str",
    "source": "str",
    "width": "int",
    "height": "int",
    "original_width": "int",
    "original_height": "int",
    # Provenance (additions to the contract; docs/rights.md): the sample's own license from
    # raw_images, else the source's `license` in sources.yaml; its url, license URL and
    # attribution ("" where the source has none).
    "license": "str",
    "url": "str",
    "license_url": "str",
    "attribution": "str",
}
# The provenance columns a sample takes from its raw_images row.
PROVENANCE_COLUMNS = ("url", "license", "license_url", "attribution")
# What a sample's fingerprint is made of: columns read without touching image bytes or
# caption text. The image stage rewrites a changed image's row (new phash, pixels, shape);
# the captions stage writes a new caption row (new created_at, n_words) when it re-captions.
FINGERPRINT_IMAGE_COLUMNS = ["tier", "width", "height", "original_width", "original_height",
                             "phash", "pixels"]
FINGERPRINT_CAPTION_COLUMNS = ["created_at", "n_words"]
# ...and the sample's provenance as the MDS sample holds it (raw_images' PROVENANCE_COLUMNS,
# the source's license where the row has none): a re-ingest that changes a licence or an
# attribution alone rewrites the sample. See `provenance_hashes`.

KEPT = "status = 'ok'"  # the bucketed rows a tree holds (with a usable caption)
DEFAULT_SIZE_LIMIT = 128 << 20  # ~128 MB shards, the design's size
DEFAULT_PLAN_ROWS = 1_000_000
DEFAULT_ROWS_PER_PART = 50_000  # one Ray task per part: ~5-20 GB of JPEGs, a few dozen shards


@dataclass(frozen=True)
class SampleInputs:
    """Where a source's samples come from: kept bucketed rows joined with usable captions.
    A build pins both tables (`pinned`), so what it plans, writes and records as lineage
    is one version of each."""

    bucketed: TableRef
    captions: TableRef
    caption_filter: str  # Lance SQL selecting the active, usable caption rows
    # Ids left out, unique (e.g. a rewrite without skipped samples): an Arrow array, as a
    # rewrite may leave out tens of millions.
    exclude_ids: pa.Array = field(default_factory=lambda: pa.array([], pa.string()))
    license: str = "unknown"  # the source's license: a sample's where it has none
    # The source's raw_images (pinned), for each sample's provenance; None: the source's
    # license and empty provenance (a tree rebuilt from tables without it).
    raw: TableRef | None = None

    @property
    def leaves_out(self) -> bool:
        return len(self.exclude_ids) > 0

    def pinned(self) -> SampleInputs:
        raw = self.raw.pinned() if self.raw is not None and self.raw.exists() else None
        return dataclasses.replace(self, bucketed=self.bucketed.pinned(),
                                   captions=self.captions.pinned(), raw=raw)


@dataclass(frozen=True)
class WriteOptions:
    size_limit: int = DEFAULT_SIZE_LIMIT
    compression: str | None = None  # JPEG bytes do not compress further
    rows_per_part: int = DEFAULT_ROWS_PER_PART
    # Kept rows a full build plans at once (`groups`): the driver's memory is bounded by
    # this, not by the source (~600 B a row).
    plan_rows: int = DEFAULT_PLAN_ROWS
    # A superseded tree stays this long (and while a reader lease holds it).
    retention: timedelta = DEFAULT_RETENTION
    parallel: bool = True  # Ray tasks; False writes the parts in this process (tiny sources)
    incremental: bool = True  # False: always a full build (a rewrite, a byte-identity check)
    # The mapping's BTREE on `id`, refreshed after each publish: a run handed its inputs'
    # changes looks the touched ids up through it, and the merge of the new rows uses it.
    mapping_index: KeyIndexPolicy = KeyIndexPolicy()


def build_settings(inputs: SampleInputs, options: WriteOptions) -> dict:
    """What every shard of a tree depends on besides the samples: a change means a full
    build (the old shards would differ from new ones)."""
    return {"size_limit": options.size_limit, "compression": options.compression,
            "caption_filter": inputs.caption_filter, "columns": MDS_COLUMNS,
            "license": inputs.license}


@dataclass(frozen=True)
class Build:
    """One run of `write_mds_tree`: what its steps share."""

    store: TreeStore  # the source's trees
    mapping: TableRef  # the source's mds_samples table
    inputs: SampleInputs  # pinned
    options: WriteOptions
    base_version: int | None  # the mapping's version before this run (None: never written)
    base_tree: str | None = None  # the current tree when it planned: what publish expects
    lease: Lease | None = None  # the source's tree lease, checked before each commit
    stage_files: StageFiles | None = None
    version: str = field(default_factory=new_tree_version)  # the tree version it makes

    @property
    def source(self) -> str:
        return self.store.source

    @property
    def log(self) -> Callable[[str], None]:
        return self.store.log

    @property
    def staging(self) -> Location:
        return self.store.staging(self.version)

    @property
    def settings(self) -> dict:
        return build_settings(self.inputs, self.options)

    def check_lease(self) -> None:
        if self.lease is not None:
            self.lease.check()


def plan_samples(inputs: SampleInputs, ids: pa.Array | None = None, where: str | None = None
                 ) -> tuple[pa.Table, Counter]:
    """Kept rows with a usable caption, sorted by (tier, width, height, id), each with its
    fingerprint, plus the rows left out by reason. Reads ids, shapes, row ids and the
    fingerprint columns only: no image bytes, no caption text. `ids`: only these ids'
    rows, looked up by id (an incremental run handed its inputs' changes); `where`: only
    the bucketed rows it selects (a group of leaves), their captions by a streamed scan."""
    bucketed = inputs.bucketed.open()
    present = set(bucketed.schema.names)
    extra = [c for c in FINGERPRINT_IMAGE_COLUMNS if c in present and c not in
             ("tier", "width", "height")]
    kept = _rows(bucketed, ["id", "tier", "width", "height", *extra],
                 f"{KEPT} AND ({where})" if where else KEPT, ids)
    kept = kept.rename_columns([*kept.column_names[:-1], "image_row"])
    captions = inputs.captions.open()
    caption_extra = [c for c in FINGERPRINT_CAPTION_COLUMNS if c in captions.schema.names]
    if where:  # a group's captions: one streamed scan (its ids are too many to look up)
        usable = scan_rows_with_ids(captions, kept["id"].combine_chunks(),
                                    ["id", *caption_extra], inputs.caption_filter,
                                    with_row_id=True)
    else:
        usable = _rows(captions, ["id", *caption_extra], inputs.caption_filter, ids)
    # Several usable rows for one id should not happen; take the first written, deterministically.
    usable = usable.group_by("id").aggregate(
        [("_rowid", "min"), *((c, "max") for c in caption_extra)])
    usable = usable.rename_columns(["id", "caption_row", *(f"caption_{c}" for c in caption_extra)])
    joined = kept.join(usable, "id", join_type="left outer")
    left_out: Counter = Counter()
    if inputs.leaves_out:
        excluded = pc.is_in(joined["id"], value_set=inputs.exclude_ids)
        left_out["excluded"] = pc.sum(excluded).as_py() or 0
        joined = joined.filter(pc.invert(excluded))
    missing = pc.is_null(joined["caption_row"])
    left_out["no_caption"] = pc.sum(missing).as_py() or 0
    joined = joined.filter(pc.invert(missing))
    parts = [*FINGERPRINT_IMAGE_COLUMNS, *(f"caption_{c}" for c in FINGERPRINT_CAPTION_COLUMNS)]
    fingerprints = sample_fingerprints(joined, [c for c in parts if c in joined.column_names])
    joined = joined.append_column("fingerprint", mix_provenance(
        fingerprints, provenance_hashes(inputs, joined["id"].combine_chunks(), ids is None)))
    order = [("tier", "ascending"), ("width", "ascending"), ("height", "ascending"),
             ("id", "ascending")]
    plan = joined.select(["id", "tier", "width", "height", "image_row", "caption_row",
                          "fingerprint"])
    return plan.sort_by(order), +left_out


def _rows(table: lance.LanceDataset, columns: list[str], where: str, ids: pa.Array | None
          ) -> pa.Table:
    """`columns` and the row id of the rows matching `where` (of `ids` only, when given)."""
    if ids is None:
        return table.to_table(columns=columns, filter=where, with_row_id=True)
    return rows_with_ids(table, ids, columns, where, with_row_id=True)


def sample_fingerprints(table: pa.Table, columns: list[str]) -> pa.Array:
    """A 64-bit mix of integer-like columns per row (nulls as 0): equal inputs, equal
    fingerprint. Changed means a different fingerprint; documented in docs/mds.md."""
    mixed = np.zeros(table.num_rows, np.uint64)
    with np.errstate(over="ignore"):
        for name in columns:
            column = table[name]
            if pa.types.is_timestamp(column.type):
                column = column.cast(pa.int64())
            values = pc.fill_null(column.cast(pa.int64()), 0).to_numpy().astype(np.uint64)
            mixed = (mixed ^ values) * np.uint64(0x9E3779B97F4A7C15)
            mixed ^= mixed >> np.uint64(31)
    return pa.array(mixed.view(np.int64), pa.int64())


def provenance_hashes(inputs: SampleInputs, ids: pa.Array, scan: bool) -> np.ndarray:
    """Per id (in `ids`' order), a 64-bit hash of the provenance its MDS sample gets (url,
    license or the source's, license_url, attribution: `parts._sample`), 0 where that is
    all default (no provenance of its own): such a sample keeps the fingerprint it had
    before provenance counted. `scan`: many ids, read by one streamed scan."""
    hashes = np.zeros(len(ids), np.uint64)
    if inputs.raw is None or not len(ids):
        return hashes
    raw = inputs.raw.open()
    columns = [c for c in PROVENANCE_COLUMNS if c in raw.schema.names]
    if not columns:
        return hashes
    read = scan_rows_with_ids if scan else rows_with_ids
    rows = read(raw, ids, ["id", *columns])
    values = [pc.fill_null(rows[c].cast(pa.string()), "") if c in columns
              else pa.array([""] * rows.num_rows, pa.string()) for c in PROVENANCE_COLUMNS]
    at = PROVENANCE_COLUMNS.index("license")  # the source's license is the default
    values[at] = pc.if_else(pc.equal(values[at], inputs.license), "", values[at])
    joined = pc.binary_join_element_wise(*values, "\x1f")
    default = pc.equal(pc.binary_length(joined), len(values) - 1)  # separators only
    # raw_images holds one row per id (ingest deletes a key's rows before appending).
    where = pc.index_in(ids, value_set=rows["id"].combine_chunks())
    found = pc.is_valid(where).to_numpy(zero_copy_only=False)
    row_hashes = np.where(default.to_numpy(zero_copy_only=False), np.uint64(0),
                          string_hashes(joined))
    hashes[found] = row_hashes[pc.drop_null(where).to_numpy()]
    return hashes


def string_hashes(strings: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """A stable 64-bit hash of each string (polynomial over its bytes, vectorised; the same
    value on every run and version, unlike Python's `hash`), 0 for the empty string."""
    array = strings.combine_chunks() if isinstance(strings, pa.ChunkedArray) else strings
    array = pa.concat_arrays([array.cast(pa.large_binary())])  # offset 0
    offsets = np.frombuffer(array.buffers()[1], np.int64)[:len(array) + 1]
    lengths = np.diff(offsets)
    out = np.zeros(len(array), np.uint64)
    if offsets[-1] == offsets[0]:
        return out
    data = np.frombuffer(array.buffers()[2], np.uint8)[offsets[0]:offsets[-1]]
    rows = np.repeat(np.arange(len(array)), lengths)
    position = (np.arange(len(data)) - (offsets[:-1] - offsets[0])[rows]).astype(np.uint64)
    with np.errstate(over="ignore"):
        terms = (data.astype(np.uint64) + np.uint64(1)) * np.power(
            np.uint64(0x100000001B3), position)
        nonempty = lengths > 0
        out[nonempty] = np.add.reduceat(terms, (offsets[:-1] - offsets[0])[nonempty])
        out[nonempty] ^= lengths[nonempty].astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    return out


def mix_provenance(fingerprints: pa.Array, hashes: np.ndarray) -> pa.Array:
    """`fingerprints` with each non-zero provenance hash mixed in (as `sample_fingerprints`
    mixes a column); a zero leaves the fingerprint as it was."""
    mixed = fingerprints.to_numpy(zero_copy_only=False).view(np.uint64).copy()
    with np.errstate(over="ignore"):
        withp = (mixed ^ hashes) * np.uint64(0x9E3779B97F4A7C15)
        withp ^= withp >> np.uint64(31)
    mixed = np.where(hashes != 0, withp, mixed)
    return pa.array(mixed.view(np.int64), pa.int64())


@dataclass
class Delta:
    """What an incremental run changes, against the current tree's mapping table."""

    write: pa.Table  # plan rows to write: new ids and changed ids, in plan order
    stale: pa.Table  # mapping rows (id, leaf, shard, sample_index) newly superseded
    removed_ids: list[str]  # ids leaving the mapping (not in the plan any more)
    reused: int  # live samples carried over unchanged

    @property
    def empty(self) -> bool:
        return self.write.num_rows == 0 and self.stale.num_rows == 0


def plan_delta(plan: pa.Table, mapping: pa.Table) -> Delta:
    """New / changed / removed / unchanged ids, from the plan's and the mapping's
    fingerprints (ids and a few integers per row; no image bytes)."""
    old = mapping.select(["id", "fingerprint", "leaf", "shard", "sample_index"]) \
        .rename_columns(["id", "old_fingerprint", "leaf", "shard", "sample_index"])
    joined = plan.select(["id", "fingerprint"]).join(old, "id", join_type="full outer")
    in_plan = pc.is_valid(joined["fingerprint"])
    in_old = pc.is_valid(joined["old_fingerprint"])
    differs = pc.fill_null(pc.not_equal(joined["fingerprint"], joined["old_fingerprint"]), True)
    to_write = pc.and_(in_plan, differs)
    superseded = pc.and_(in_old, differs)
    write_ids = joined.filter(to_write)["id"]
    stale = joined.filter(superseded).select(["id", "leaf", "shard", "sample_index"])
    removed = joined.filter(pc.invert(in_plan))["id"].to_pylist()
    reused = int(pc.sum(pc.and_(in_old, pc.invert(differs))).as_py() or 0)
    write = plan.filter(pc.is_in(plan["id"], value_set=write_ids))
    return Delta(write=write, stale=stale, removed_ids=sorted(removed), reused=reused)


def split_leaves(plan: pa.Table) -> list[tuple[tuple[int, int, int], pa.Table]]:
    """The sorted plan cut into one slice per (tier, width, height), in order. The cuts are
    found on the key columns' buffers (a few bytes per row), not on Python tuples."""
    if plan.num_rows == 0:
        return []
    tier, width, height = (plan[c].to_numpy() for c in ("tier", "width", "height"))
    changes = np.zeros(plan.num_rows - 1, bool)
    for values in (tier, width, height):
        changes |= values[1:] != values[:-1]
    starts = [0, *(np.flatnonzero(changes) + 1).tolist()]
    stops = [*starts[1:], plan.num_rows]
    return [((int(tier[start]), int(width[start]), int(height[start])),
             plan.slice(start, stop - start)) for start, stop in zip(starts, stops, strict=True)]
