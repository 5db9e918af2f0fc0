"""What the pipeline threw away: `bucketed_images` rows whose status is not `ok` (too small,
bad aspect, and files that could not be read, whose raw status the image stage carries),
per reason and source, with a thumbnail of each image that decodes.

A curator's first question is "what did we throw away, and was it right?": the corpus holds
only kept images, so these come from the per-source tables. Counts read the status column
alone (once per table version); a page reads at most REJECT_PAGE rows; a thumbnail decodes
one raw image.
"""

from __future__ import annotations

import io
from collections import Counter
from dataclasses import dataclass

import pyarrow.compute as pc
from PIL import Image

from prx_assets.browser.catalog import NAME, BadQuery, Catalog, NotFound, valid_id
from prx_assets.stages.images.buckets import STATUS_BAD_ASPECT, STATUS_TOO_SMALL
from prx_assets.storage.filters import eq_filter
from prx_assets.storage.tables import BUCKETED_IMAGES, RAW_IMAGES

REJECT_PAGE = 48
THUMB_PX = 256
# Rejected for their size or shape: they decode, so they have a thumbnail.
DECODED_REJECTS = (STATUS_TOO_SMALL, STATUS_BAD_ASPECT)
REJECT_COLUMNS = ["id", "source", "status", "original_width", "original_height", "error"]


@dataclass(frozen=True)
class RejectCount:
    source: str
    reason: str
    count: int


def reject_counts(catalog: Catalog) -> list[RejectCount]:
    """Rows not kept, per source and reason, most first."""
    counts = []
    for source in catalog.sources_of(BUCKETED_IMAGES):
        table = catalog.dataset(BUCKETED_IMAGES, source)
        if table is None:
            continue

        def compute(table=table) -> Counter:
            found: Counter = Counter()
            for batch in table.to_batches(columns=["status"], filter="status != 'ok'"):
                found.update(batch.column("status").to_pylist())
            return found

        per_reason = catalog.cached(("rejects", table.uri, table.version), compute)
        counts += [RejectCount(source, reason, n) for reason, n in per_reason.items()]
    return sorted(counts, key=lambda c: (-c.count, c.source, c.reason))


def largest_reason(counts: list[RejectCount]) -> str | None:
    """The reason with the most rejected rows across sources (None when nothing was)."""
    totals: Counter = Counter()
    for count in counts:
        totals[count.reason] += count.count
    return min(totals, key=lambda reason: (-totals[reason], reason)) if totals else None


@dataclass
class RejectPage:
    reason: str
    source: str
    rows: list[dict]  # REJECT_COLUMNS, plus `decodes`
    total: int
    page: int
    pages: int


def rejects(catalog: Catalog, reason: str, source: str = "", page: int = 0) -> RejectPage:
    """One page of the images rejected for `reason` (of one source, or of every source)."""
    if not NAME.match(reason or ""):
        raise BadQuery("reason must be a reason name")
    if source and source not in catalog.sources_of(BUCKETED_IMAGES):
        raise NotFound(f"no source {source!r}")
    sources = [source] if source else catalog.sources_of(BUCKETED_IMAGES)
    where = eq_filter("status", reason)
    skip, total = page * REJECT_PAGE, 0
    rows: list[dict] = []
    for name in sources:
        table = catalog.dataset(BUCKETED_IMAGES, name)
        if table is None:
            continue
        n = table.count_rows(filter=where)
        total += n
        if skip >= n:  # this source's rows all lie before the page
            skip -= n
            continue
        wanted = REJECT_PAGE - len(rows)
        if wanted > 0:
            found = table.to_table(columns=REJECT_COLUMNS, filter=where, offset=skip,
                                   limit=wanted).to_pylist()
            rows += [{**row, "decodes": row["status"] in DECODED_REJECTS} for row in found]
        skip = 0
    return RejectPage(reason, source, rows, total, page, max(1, -(-total // REJECT_PAGE)))


def reject_thumbnail(catalog: Catalog, sample_id: str) -> tuple[bytes, int]:
    """A JPEG thumbnail of a rejected image that decodes, from its raw bytes, and the
    raw_images version it came from."""
    return raw_preview(catalog, sample_id, THUMB_PX)


def raw_preview(catalog: Catalog, sample_id: str, max_px: int) -> tuple[bytes, int]:
    """The raw image (the original, before bucketing) as a JPEG at most `max_px` on its
    longest side, and the raw_images version it came from."""
    valid_id(sample_id)
    sources = catalog.sources_of(RAW_IMAGES)
    source = next((s for s in sources if sample_id.startswith(f"{s}:")), None)
    table = catalog.dataset(RAW_IMAGES, source) if source else None
    if table is None:
        raise NotFound(f"no raw image for {sample_id!r}")
    rows = table.to_table(columns=["image"], filter=pc.field("id") == sample_id, limit=1)
    data = rows.column("image")[0].as_py() if rows.num_rows else None
    if not data:
        raise NotFound(f"no raw image for {sample_id!r}")
    try:
        with Image.open(io.BytesIO(data)) as img:
            img.thumbnail((max_px, max_px))
            out = io.BytesIO()
            img.convert("RGB").save(out, "JPEG", quality=85)
    except (OSError, ValueError, Image.DecompressionBombError) as err:
        raise NotFound(f"{sample_id!r} does not decode: {err}") from None
    return out.getvalue(), table.version
