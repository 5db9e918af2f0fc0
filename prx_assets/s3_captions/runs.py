"""Incremental, resumable captioning of one source.

Work = kept images (bucketed_images, status "ok") minus the ids already done under the
version (broadcast set membership for small sets, a Ray hash join past a million ids). Results stream back
to the driver and are committed to the captions table in chunks with a Lance merge-insert
keyed on (id, caption_version): a killed run loses at most the chunk in flight, a rerun
never duplicates a row, and a retried failure replaces its failed row.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import lance
import pyarrow as pa
import pyarrow.compute as pc
import ray.data

from prx_assets.s3_captions.captioners import CaptionerSpec, caption_stage
from prx_assets.s3_captions.captions import CAPTIONS_SCHEMA, STATUS_OK, done_filter
from prx_assets.storage.filters import eq_filter, in_filter
from prx_assets.storage.lance_tables import (
    FragmentPolicy, cleanup, compact, prepare_output_dir, table_exists, upsert)

CAPTION_KEYS = ["id", "caption_version"]
CAPTIONS_FRAGMENTS = FragmentPolicy(target_bytes=1 << 30, max_rows=1 << 20)


@dataclass
class CaptionRunReport:
    version: str
    pending: int = 0
    written: int = 0
    chunks: int = 0
    seconds: float = 0.0
    statuses: Counter = field(default_factory=Counter)
    word_counts: list[int] = field(default_factory=list)
    lance_version: int | None = None

    @property
    def images_per_s(self) -> float:
        return self.written / self.seconds if self.seconds > 0 else 0.0


# Below this many ids, set membership is broadcast to every task (no shuffle); above it,
# a hash-partitioned Ray join keeps memory bounded per node.
BROADCAST_IDS = 1_000_000


def done_ids(captions_uri: Path, version: str) -> tuple[ray.data.Dataset | None, int]:
    """Ids that need no more work under `version`, and how many there are."""
    if not table_exists(captions_uri):
        return None, 0
    count = lance.dataset(str(captions_uri)).count_rows(filter=done_filter(version))
    if count == 0:
        return None, 0
    ids = ray.data.read_lance(str(captions_uri), columns=["id"], filter=done_filter(version))
    return ids, count


def pending_requests(bucketed: ray.data.Dataset, raw_captions: ray.data.Dataset | None,
                     captions_uri: Path, spec: CaptionerSpec) -> ray.data.Dataset:
    """Rows {id, image?, original_caption?} of kept images not yet captioned."""
    columns = ["id", "image"] if spec.uses_model else ["id"]
    # Project first so the read skips image bytes when the backend needs none.
    kept = bucketed.select_columns([*columns, "status"]).filter(
        lambda row: row["status"] == STATUS_OK)
    requests = kept.select_columns(columns)
    done, n_done = done_ids(captions_uri, spec.version())
    if done is not None:
        requests = without_ids(requests, done, n_done)
    if not spec.uses_model and raw_captions is not None:
        requests = with_source_captions(requests, raw_captions)
    return requests


def _collect_ids(ids: ray.data.Dataset, limit: int | None = None) -> pa.Array | None:
    """The ids as one array, or None once there are more than `limit` (then join instead)."""
    chunks, n = [], 0
    for batch in ids.iter_batches(batch_format="pyarrow", batch_size=65536):
        chunks.append(batch.column("id"))
        n += batch.num_rows
        if limit is not None and n > limit:
            return None
    return pa.chunked_array(chunks, pa.string()).combine_chunks() if chunks \
        else pa.array([], pa.string())


def _keep_rows(batch: pa.Table, ids: pa.Array, member: bool) -> pa.Table:
    mask = pc.is_in(batch.column("id"), value_set=ids)
    return batch.filter(mask if member else pc.invert(mask))


def without_ids(rows: ray.data.Dataset, ids: ray.data.Dataset, n_ids: int) -> ray.data.Dataset:
    """Anti-join on id: broadcast for small id sets, hash-partitioned join for large ones."""
    if n_ids > BROADCAST_IDS:
        return rows.join(ids, join_type="left_anti", on=("id",), num_partitions=_partitions(n_ids))
    return rows.map_batches(_keep_rows, fn_kwargs={"ids": _collect_ids(ids), "member": False},
                            batch_format="pyarrow", zero_copy_batch=True)


def with_source_captions(requests: ray.data.Dataset, raw_captions: ray.data.Dataset
                         ) -> ray.data.Dataset:
    """The `original` backend's input: the source caption of each requested id."""
    captions = raw_captions.select_columns(["id", "original_caption"])
    ids = _collect_ids(requests, limit=BROADCAST_IDS)  # one pass over the requests
    if ids is None:
        return requests.join(captions, join_type="inner", on=("id",),
                             num_partitions=_partitions(BROADCAST_IDS))
    return captions.map_batches(_keep_rows, fn_kwargs={"ids": ids, "member": True},
                                batch_format="pyarrow", zero_copy_batch=True)


def _item_keys(raw_uri: Path, version: int, with_caption: bool) -> ray.data.Dataset:
    """One string per raw row, `id`, sha256 of the original bytes (and the source caption):
    equal keys in two versions mean the same item with the same content."""
    columns = ["id", "sha256", "original_caption"] if with_caption else ["id", "sha256"]

    def keys(batch: pa.Table) -> pa.Table:
        parts = [pc.fill_null(batch.column(c), "") for c in columns]
        return pa.table({"id": pc.binary_join_element_wise(*parts, "\x00")})

    return ray.data.read_lance(str(raw_uri), version=version, columns=columns).map_batches(
        keys, batch_format="pyarrow")


def changed_ids(raw_uri: Path, old_version: int, new_version: int, with_caption: bool
                ) -> set[str]:
    """Ids of raw_images `old_version` whose item is gone or different in `new_version`
    (the same key path, new bytes or a new source caption): their captions are stale."""
    new_keys = _item_keys(raw_uri, new_version, with_caption)
    n_new = lance.dataset(str(raw_uri), version=new_version).count_rows()
    gone = without_ids(_item_keys(raw_uri, old_version, with_caption), new_keys, n_new)
    return {key.split("\x00", 1)[0] for key in _collect_ids(gone).to_pylist()}


def drop_captions(captions_uri: Path, ids: set[str], chunk: int = 10_000) -> int:
    """Delete every caption row (all versions) of these ids; returns the rows deleted."""
    if not ids or not table_exists(captions_uri):
        return 0
    table = lance.dataset(str(captions_uri))
    before = table.count_rows()
    ordered = sorted(ids)
    for start in range(0, len(ordered), chunk):
        table.delete(in_filter("id", ordered[start:start + chunk]))
    return before - lance.dataset(str(captions_uri)).count_rows()


def _partitions(rows: int) -> int:
    return max(4, min(512, rows // 500_000))


def caption_source(requests: ray.data.Dataset, captions_uri: Path, spec: CaptionerSpec,
                   chunk_rows: int = 1024,
                   on_chunk: Callable[[CaptionRunReport], None] | None = None
                   ) -> CaptionRunReport:
    """Caption `requests` and commit the results chunk by chunk."""
    report = CaptionRunReport(version=spec.version())
    started = time.perf_counter()
    results = caption_stage(requests, spec)
    for chunk in results.iter_batches(batch_size=chunk_rows, batch_format="pyarrow"):
        report.lance_version = upsert(captions_uri, chunk, CAPTIONS_SCHEMA, CAPTION_KEYS)
        report.written += chunk.num_rows
        report.chunks += 1
        report.statuses.update(chunk.column("status").to_pylist())
        ok = pc.equal(chunk.column("status"), STATUS_OK)
        report.word_counts.extend(chunk.filter(ok).column("n_words").to_pylist())
        report.seconds = time.perf_counter() - started
        if on_chunk:
            on_chunk(report)
    report.seconds = time.perf_counter() - started
    if report.chunks > 1 and table_exists(captions_uri):
        compact(captions_uri, CAPTIONS_FRAGMENTS)
        cleanup(lance.dataset(str(captions_uri)), CAPTIONS_FRAGMENTS)
    if table_exists(captions_uri):
        report.lance_version = lance.dataset(str(captions_uri)).version
    return report


def ensure_table(uri: Path) -> int:
    """An empty captions table for a source with nothing to caption (downstream can read it)."""
    if table_exists(uri):
        return lance.dataset(str(uri)).version
    prepare_output_dir(uri, "Lance table")
    return lance.write_dataset(CAPTIONS_SCHEMA.empty_table(), str(uri),
                               schema=CAPTIONS_SCHEMA, mode="create").version


@dataclass(frozen=True)
class Coverage:
    kept: int
    done: int
    ok: int
    failed: int
    in_target: int

    @property
    def share(self) -> float:
        return self.done / self.kept if self.kept else 1.0


def coverage(bucketed_uri: Path, captions_uri: Path, version: str,
             target: tuple[int, int] = (100, 200)) -> Coverage:
    """Counts for the checks, read from the committed tables (metadata columns only)."""
    kept = lance.dataset(str(bucketed_uri)).count_rows(filter=eq_filter("status", STATUS_OK)) \
        if table_exists(bucketed_uri) else 0
    if not table_exists(captions_uri):
        return Coverage(kept, 0, 0, 0, 0)
    table = lance.dataset(str(captions_uri))
    rows = table.to_table(columns=["status", "n_words"],
                          filter=eq_filter("caption_version", version))
    statuses = Counter(rows.column("status").to_pylist())
    words = rows.filter(pc.equal(rows.column("status"), STATUS_OK)).column("n_words")
    in_target = pc.sum(pc.and_(pc.greater_equal(words, target[0]),
                               pc.less_equal(words, target[1]))).as_py() or 0
    done = sum(n for s, n in statuses.items() if s != "failed")
    return Coverage(kept, done, statuses.get(STATUS_OK, 0), statuses.get("failed", 0), in_target)
