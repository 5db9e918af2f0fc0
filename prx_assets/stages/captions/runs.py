"""Incremental, resumable captioning of one source.

Work = kept images (bucketed_images, status "ok") minus the ids already done under the
version. The chunked-commit runner (`engine.chunked`) streams the captions back to the
driver and merge-inserts them in chunks keyed on (id, caption_version): a killed run loses
at most the chunk in flight, a rerun never duplicates a row, and a retried failure replaces
its failed row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc
import ray.data

from prx_assets.engine.batches import batch_fn
from prx_assets.engine.chunked import BROADCAST_IDS as DEFAULT_BROADCAST_IDS
from prx_assets.engine.chunked import (
    collect_ids,
    drop_ids,
    hash_partitions,
    keep_ids,
    pending_rows,
    without_ids,
)
from prx_assets.engine.id_sets import IdSet
from prx_assets.engine.removals import DELETE_IDS_PER_COMMIT, delete_ids
from prx_assets.engine.stage import (
    Coverage,
    Pending,
    Stage,
    StageReport,
    TableSpec,
    commit_pending,
    coverage,
)
from prx_assets.stages.captions.captioners import CaptionerSpec, caption_stage
from prx_assets.stages.captions.captions import (
    CAPTIONS_SCHEMA,
    STATUS_FAILED,
    STATUS_OK,
    done_filter,
)
from prx_assets.storage.changes import (
    Changes,
    changes_since,
    read_consumed,
    read_ids,
    rows_with_ids,
)
from prx_assets.storage.filters import all_of, eq_filter
from prx_assets.storage.lance_tables import only_appended_since
from prx_assets.storage.refs import TableRef

CAPTIONS_TABLE = TableSpec(CAPTIONS_SCHEMA, ("id", "caption_version"))
UPSTREAM = "bucketed_images"  # what the captions table's record of the kept images is called


@dataclass
class CaptionRunReport(StageReport):
    version: str
    word_counts: list[int] = field(default_factory=list)


    @property
    def images_per_s(self) -> float:
        return self.written / self.seconds if self.seconds > 0 else 0.0


# Up to this many ids the id sets captioning compares are broadcast to the tasks, past it
# they are joined (read at call time, so a test can force the join path).
BROADCAST_IDS = DEFAULT_BROADCAST_IDS
# A model backend's run with at most this many pending images reads only their bytes, by id
# (one `IN` filter); with more it reads every kept image once.
IMAGE_LOOKUP_IDS = 10_000


def pending_requests(bucketed: ray.data.Dataset, raw_captions: ray.data.Dataset | None,
                     captions: TableRef, spec: CaptionerSpec) -> ray.data.Dataset:
    """Rows {id, image?, original_caption?} of kept images not yet captioned."""
    columns = request_columns(spec)
    kept = bucketed.select_columns([*columns, "status"]).map_batches(
        _kept_only, batch_format="pyarrow", zero_copy_batch=True)
    requests = pending_rows(kept.select_columns(columns), captions,
                            done_filter(spec.version()), BROADCAST_IDS)
    if not spec.uses_model and raw_captions is not None:
        requests = with_source_captions(requests, raw_captions)
    return requests


def pending_ids(bucketed: TableRef, captions: TableRef, spec: CaptionerSpec,
                limit: int = IMAGE_LOOKUP_IDS) -> pa.Array | None:
    """The kept ids (of the pinned bucketed version) not yet captioned under `spec`'s
    version, selected from a read of ids alone; None past `limit` (read every kept image
    once, `pending_requests`: a first run, a new caption version)."""
    ids = bucketed.read(columns=["id"], filter=eq_filter("status", STATUS_OK))
    return collect_ids(pending_rows(ids, captions, done_filter(spec.version()), BROADCAST_IDS),
                       limit)


def bucketed_changes(bucketed: TableRef, captions: TableRef, spec: CaptionerSpec
                     ) -> Changes | None:
    """What changed in bucketed_images (the pinned version) since the captions of `spec`'s
    version last consumed all of it; None without such a record (compare every kept id)."""
    since = read_consumed(captions, UPSTREAM, tag=spec.version())
    return changes_since(bucketed.open(), since) if since is not None else None


def pending_changed_ids(bucketed: TableRef, changes: Changes, captions: TableRef,
                        spec: CaptionerSpec, also: pa.Array | None = None,
                        limit: int = IMAGE_LOOKUP_IDS) -> pa.Array | None:
    """The ids to caption, from bucketed's changes since the record instead of every kept
    id: kept images in fragments written since (new ones, replaced ones), kept images whose
    caption failed (retried) and kept ones among `also` (items whose caption was dropped as
    stale), less those done under this version. None past `limit`: after a compaction of
    bucketed every row comes as written, so the run compares every id once."""
    if changes.added_rows > limit:
        return None
    added = bucketed.to_table(columns=["id"], filter=all_of(
        eq_filter("status", STATUS_OK), changes.added_filter)).column("id")
    failed = captions.latest().to_table(columns=["id"], filter=all_of(
        eq_filter("caption_version", spec.version()), eq_filter("status", STATUS_FAILED))
    ).column("id")
    others = pa.chunked_array([failed, also if also is not None else []], pa.string())
    if len(others):
        others = kept_ids(bucketed, others.combine_chunks())
    offered = pc.unique(pa.chunked_array([added, others], pa.string()).combine_chunks())
    if len(offered) > limit:
        return None
    done = rows_with_ids(captions.latest().open(), offered, ["id"],
                         where=done_filter(spec.version())).column("id")
    return offered.filter(pc.invert(pc.is_in(offered, done)))


def kept_ids(bucketed: TableRef, ids: pa.Array) -> pa.ChunkedArray:
    """Those of `ids` that are kept images (looked up through bucketed's key index)."""
    return rows_with_ids(bucketed.open(), ids, ["id"],
                         where=eq_filter("status", STATUS_OK)).column("id")


def awaiting_new_images(bucketed: TableRef, raw: TableRef, ids: pa.Array) -> pa.Array:
    """Those of `ids` whose bucketed row was made from other bytes than raw_images holds
    now (both pinned): a replaced file the image stage has not processed yet. A model
    captioning it now would describe the old image, and the caption would stay once the
    new image came (it is done under this version)."""
    table = bucketed.open()
    if len(ids) == 0 or "raw_sha256" not in table.schema.names:
        return ids[:0]
    made = rows_with_ids(table, ids, ["id", "raw_sha256"])
    now = rows_with_ids(raw.open(), ids, ["id", "sha256"])
    joined = made.join(now, "id", join_type="left outer")
    differs = pc.fill_null(pc.not_equal(joined["raw_sha256"], joined["sha256"]), True)
    return joined.filter(differs).column("id").combine_chunks()


def requests_for(bucketed: TableRef, ids: pa.Array, raw: TableRef | None = None
                 ) -> ray.data.Dataset | None:
    """The requests for these ids, read by id: a model backend's {id, image} from bucketed
    (a +1 run used to read every kept image of the source to keep the one pending), the
    `original` backend's {id, original_caption} from `raw`. None when there are none: no
    model is loaded."""
    if raw is not None:
        return read_ids(raw, ids, ["id", "original_caption"])
    return read_ids(bucketed, ids, ["id", "image"], eq_filter("status", STATUS_OK))


def request_columns(spec: CaptionerSpec) -> list[str]:
    """The bucketed columns a backend needs: the images only when a model looks at them."""
    return ["id", "image"] if spec.uses_model else ["id"]


def read_kept(bucketed: TableRef, spec: CaptionerSpec) -> ray.data.Dataset:
    """The kept rows of a bucketed table with the columns `spec` needs, filtered and
    projected by Lance itself: Ray Data does not push a later projection into a Lance read,
    so selecting ids from a full read read every image of the source (3.5 GB at 10,000
    images) for a backend that looks at none."""
    return bucketed.read(columns=[*request_columns(spec), "status"],
                         filter=eq_filter("status", STATUS_OK))


def _kept_only(batch: pa.Table) -> pa.Table:
    return batch.filter(pc.equal(batch.column("status"), STATUS_OK))


def with_source_captions(requests: ray.data.Dataset, raw_captions: ray.data.Dataset
                         ) -> ray.data.Dataset:
    """The `original` backend's input: the source caption of each requested id."""
    captions = raw_captions.select_columns(["id", "original_caption"])
    ids = collect_ids(requests, limit=BROADCAST_IDS)  # one pass over the requests
    if ids is None:
        return requests.join(captions, join_type="inner", on=("id",),
                             num_partitions=hash_partitions(BROADCAST_IDS))
    return captions.map_batches(batch_fn(keep_ids),
                                fn_kwargs={"ids": IdSet.of(ids), "member": True},
                                batch_format="pyarrow", batch_size=None, zero_copy_batch=True)


def count_pending(bucketed: TableRef, captions: TableRef, version: str) -> int:
    """About how many requests `pending_requests` yields, from two row counts (no pass over
    the data): kept images less the captions of `version` that need no more work."""
    if not bucketed.exists():
        return 0
    kept = bucketed.count_rows(filter=eq_filter("status", STATUS_OK))
    done = captions.latest().count_rows(filter=done_filter(version)) \
        if captions.exists() else 0
    return max(0, kept - done)


def _item_keys(raw: TableRef, with_caption: bool) -> ray.data.Dataset:
    """One string per raw row, `id`, sha256 of the original bytes (and the source caption):
    equal keys in two versions mean the same item with the same content."""
    columns = ["id", "sha256", "original_caption"] if with_caption else ["id", "sha256"]

    def keys(batch: pa.Table) -> pa.Table:
        parts = [pc.fill_null(batch.column(c), "") for c in columns]
        return pa.table({"id": pc.binary_join_element_wise(*parts, "\x00")})

    return raw.read(columns=columns).map_batches(keys, batch_format="pyarrow")


def changed_ids(raw: TableRef, old_version: int, new_version: int,
                with_caption: bool) -> set[str]:
    """Ids of raw_images `old_version` whose item is gone or different in `new_version`
    (the same key path, new bytes or a new source caption): their captions are stale.
    None when the new version only appended rows (the common +N files run): no pass over
    either version."""
    if only_appended_since(raw, old_version, new_version):
        return set()
    new_keys = _item_keys(raw.at(new_version), with_caption)
    n_new = raw.at(new_version).count_rows()
    gone = without_ids(_item_keys(raw.at(old_version), with_caption),
                       new_keys, n_new, BROADCAST_IDS)
    return {key.split("\x00", 1)[0] for key in collect_ids(gone).to_pylist()}


def drop_captions(captions: TableRef, ids: set[str], chunk: int = DELETE_IDS_PER_COMMIT) -> int:
    """Delete every caption row (all versions) of these ids; returns the rows deleted."""
    return delete_ids(captions.latest(), pa.array(sorted(ids), pa.string()), chunk)


def caption_requests(bucketed: TableRef, raw: TableRef, raw_images: ray.data.Dataset | None,
                     captions: TableRef, spec: CaptionerSpec, changed: set[str]
                     ) -> ray.data.Dataset | None:
    """The pending requests. With the captions' record of bucketed, from its changes since
    (and, for the `original` backend, the items whose source caption changed: bucketed
    does not change with it); without one, or past a few thousand, from every kept id: a
    model backend selects ids first and reads only their images. A model backend leaves
    out changed items whose new image the image stage has not made yet."""
    changes = bucketed_changes(bucketed, captions, spec)
    changed_ids = pa.array(sorted(changed), pa.string())
    ids = pending_changed_ids(bucketed, changes, captions, spec,
                              None if spec.uses_model else changed_ids) \
        if changes is not None else None
    if not spec.uses_model:
        return requests_for(bucketed, ids, raw) if ids is not None else \
            pending_requests(read_kept(bucketed, spec), raw_images, captions, spec)
    # A replaced file waits for its new image (its bucketed row comes with a later change).
    waiting = awaiting_new_images(bucketed, raw, changed_ids)
    if ids is None:
        ids = pending_ids(bucketed, captions, spec)
    if ids is not None:
        return requests_for(bucketed, ids.filter(pc.invert(pc.is_in(ids, waiting))))
    return drop_ids(pending_requests(read_kept(bucketed, spec), raw_images, captions, spec),
                    waiting)


class CaptionStage(Stage[CaptionRunReport]):
    """Kept images (bucketed_images) in, one caption per kept image out under the spec's
    caption version; a failed caption is written as failed and retried by the next run. Its
    record of bucketed is made whatever failed (failures are looked up, not handed on)."""

    table = CAPTIONS_TABLE
    upstream = UPSTREAM
    failpoint = "captions.chunk_committed"

    def __init__(self, spec: CaptionerSpec, raw: TableRef | None = None,
                 changed: set[str] | None = None):
        self.spec, self.raw, self.changed = spec, raw, changed or set()

    def report(self) -> CaptionRunReport:
        return CaptionRunReport(version=self.spec.version())

    def record_tag(self) -> str:
        return self.spec.version()

    def pending(self, upstream: TableRef, target: TableRef, report: CaptionRunReport
                ) -> Pending:
        assert self.raw is not None, "a captions run reads raw_images (the source captions)"
        raw_captions = self.raw.read(columns=["id", "original_caption"])
        return Pending(count_pending(upstream, target, self.spec.version()), caption_requests(
            upstream, self.raw, raw_captions, target, self.spec, self.changed))

    def transform(self, rows: ray.data.Dataset, count: int) -> ray.data.Dataset:
        return caption_stage(rows, self.spec)

    def count(self, chunk: pa.Table, report: CaptionRunReport) -> None:
        report.counts.update(chunk.column("status").to_pylist())
        ok = pc.equal(chunk.column("status"), STATUS_OK)
        report.word_counts.extend(chunk.filter(ok).column("n_words").to_pylist())


def caption_source(requests: ray.data.Dataset | None, captions: TableRef, spec: CaptionerSpec,
                   chunk_rows: int = 1024,
                   on_chunk: Callable[[CaptionRunReport], None] | None = None
                   ) -> CaptionRunReport:
    """Caption `requests` selected by the caller (a benchmark, a test) and commit the results
    chunk by chunk; the asset runs the whole stage (`run_stage(CaptionStage(...))`)."""
    stage = CaptionStage(spec)
    return commit_pending(stage, Pending(0, requests), captions, chunk_rows, stage.report(),
                          on_chunk)


def captions_coverage(bucketed: TableRef, captions: TableRef, version: str) -> Coverage:
    """Kept images, and the captions of `version` by status (read from the committed
    tables, metadata columns only)."""
    return coverage(bucketed, eq_filter("status", STATUS_OK), captions, "status",
                    eq_filter("caption_version", version))


def done_rows(cover: Coverage) -> int:
    """Kept images with a caption that needs no more work (any status but failed)."""
    return cover.rows() - cover.rows(STATUS_FAILED)


def in_target_rows(captions: TableRef, version: str, target: tuple[int, int] = (100, 200)
                   ) -> int:
    """Captions of `version` whose length is within `target` words."""
    if not captions.exists():
        return 0
    return captions.count_rows(filter=all_of(
        eq_filter("caption_version", version), eq_filter("status", STATUS_OK),
        f"n_words >= {int(target[0])}", f"n_words <= {int(target[1])}"))
