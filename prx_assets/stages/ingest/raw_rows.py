"""Rows of the `raw_images` table, built from whatever a reader found for one item."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from prx_assets.stages.ingest.ids import sample_id
from prx_assets.stages.ingest.probe import DEFAULT_MAX_PIXELS, STATUS_OK, probe_image, sha256_hex
from prx_assets.stages.ingest.rights import NONE, PROHIBITED, Reservation, read_reservation
from prx_assets.storage.tables import image_bytes_field

UNKNOWN_LICENSE = "unknown"

DEFAULT_MAX_CAPTION_BYTES = 16 << 10  # a source's caption above this is cut (with a note)

# Provenance (docs/rights.md), in raw_images and carried as they are into the corpus.
PROVENANCE_FIELDS = [
    # Where the item was fetched from, when the source says (opt-outs by url).
    pa.field("url", pa.string()),
    # The sample's own license where its sidecar or row has one, else the source's
    # `license` in sources.yaml, else "unknown"; its license's URL and the attribution it
    # asks for where given.
    pa.field("license", pa.string()),
    pa.field("license_url", pa.string()),
    pa.field("attribution", pa.string()),
    # The training reservation read from the bytes and the sidecar (rights.py): "none",
    # "prohibited" or "constrained", and what said so.
    pa.field("reservation", pa.string()),
    pa.field("reservation_signal", pa.string()),
]

RAW_IMAGES_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("source", pa.string(), nullable=False),
        pa.field("source_key", pa.string(), nullable=False),
        image_bytes_field(),
        pa.field("format", pa.string()),
        pa.field("width", pa.int32()),
        pa.field("height", pa.int32()),
        pa.field("n_bytes", pa.int64()),
        pa.field("sha256", pa.string()),
        pa.field("original_caption", pa.string()),
        pa.field("status", pa.string(), nullable=False),
        pa.field("error", pa.string()),
        *PROVENANCE_FIELDS,
        # Change detection (docs/sources.md): the unit the row came from (a file, a tar, a
        # parquet file, a Lance fragment), what the listing said of that unit when it was
        # read (size and mtime, or the Lance version), and, on the unit's last row only, how
        # many rows the unit yielded: a unit is complete once that many rows carry its
        # signature, so a unit cut off by a kill between chunks is read again.
        pa.field("unit", pa.string()),
        pa.field("unit_signature", pa.string()),
        pa.field("unit_items", pa.int64()),
    ]
)
# The columns change detection reads back from a committed table.
UNIT_COLUMNS = ("unit", "unit_signature", "unit_items")
UNIT_KEYS = UNIT_COLUMNS[:2]  # a unit as the listing names it: which file, which version of it


@dataclass(frozen=True)
class FoundItem:
    """One item as a reader found it: bytes, or the reason it could not get them."""

    key: str
    data: bytes | None = None
    caption: str | None = None
    status: str | None = None  # set when the reader itself failed (unreadable, unsafe_path...)
    error: str | None = None
    url: str | None = None
    # Provenance and rights fields from the item's sidecar or row (readers.provenance_of).
    meta: Mapping[str, object] | None = None


# A row whose reservation `raw_row(defer_rights=True)` left to `read_reservations` holds
# its sidecar under this key (no table has it), and until then reads as reserved.
_UNREAD_SIDECAR = "_unread_rights_sidecar"
UNREAD_SIGNAL = "rights=not read yet (deferred to its block)"


def raw_row(source: str, item: FoundItem, max_pixels: int = DEFAULT_MAX_PIXELS,
            max_caption_bytes: int = DEFAULT_MAX_CAPTION_BYTES,
            source_license: str = UNKNOWN_LICENSE, read_rights: bool = True,
            defer_rights: bool = False) -> dict:
    """Probe the item's bytes (header only) and return its `raw_images` row, with its
    provenance and its reservation (`read_rights=False` leaves the signals unread: the
    bench's baseline; `defer_rights=True` leaves them to `read_reservations`, the row
    `prohibited` until then). A caption over `max_caption_bytes` (UTF-8) is cut there, and
    the row's `error` says so."""
    caption, cut_note = capped_caption(item.caption, max_caption_bytes)
    row: dict[str, Any] = {
        "id": sample_id(source, item.key),
        "source": source,
        "source_key": item.key,
        "image": None,
        "format": None,
        "width": None,
        "height": None,
        "n_bytes": len(item.data) if item.data is not None else None,
        "sha256": sha256_hex(item.data) if item.data else None,
        "original_caption": caption,
        "status": item.status,
        "error": item.error,
        "url": item.url,
        **provenance(item.meta, source_license),
        "reservation": NONE,
        "reservation_signal": None,
        "unit": None,
        "unit_signature": None,
        "unit_items": None,
    }
    if item.status is not None:
        return row
    probe = probe_image(item.data, max_pixels=max_pixels)
    row.update(status=probe.status, error=probe.error, format=probe.format,
               width=probe.width, height=probe.height)
    if probe.status == STATUS_OK:
        row["image"] = item.data  # original bytes, untouched
        if read_rights and defer_rights:  # fail closed: reserved until it is read
            row.update({"reservation": PROHIBITED, "reservation_signal": UNREAD_SIGNAL,
                        _UNREAD_SIDECAR: item.meta})
        elif read_rights:
            _reserve(row, read_reservation(item.data, item.meta))
    if cut_note and row["error"] is None:
        row["error"] = cut_note
    return row


def read_reservations(rows: list[dict]) -> None:
    """Read the reservations `raw_row(defer_rights=True)` left, for a block of rows
    together. Read row by row, between one row's hash, probe and tar read and the next
    one's, the readers' code is out of the CPU's caches again at every row: their cost in
    the ingest's loop is twice what it is hot, and a block of 64 rows saves about a third
    of it (docs/rights.md, Cost)."""
    for row in rows:
        if _UNREAD_SIDECAR in row:
            _reserve(row, read_reservation(row["image"], row.pop(_UNREAD_SIDECAR)))


def _reserve(row: dict, reservation: Reservation) -> None:
    if reservation.findings:
        row.update(reservation=reservation.status, reservation_signal=reservation.signal)
    else:  # most rows: no signal
        row.update(reservation=NONE, reservation_signal=None)


def provenance(meta: Mapping[str, object] | None, source_license: str) -> dict:
    """The row's license, license_url and attribution."""
    meta = meta or {}

    def text(field: str) -> str | None:
        value = meta.get(field)
        return str(value).strip() or None if value is not None else None

    return {"license": text("license") or source_license or UNKNOWN_LICENSE,
            "license_url": text("license_url"), "attribution": text("attribution")}


def capped_caption(caption: str | None, max_bytes: int) -> tuple[str | None, str | None]:
    """(the caption cut to at most `max_bytes` of UTF-8 on a character boundary, a note
    saying what was cut), the caption as it is and None when it fits."""
    if caption is None or len(caption) * 4 <= max_bytes:  # cheap: no encode when it must fit
        return caption, None
    data = caption.encode("utf-8", errors="replace")
    if len(data) <= max_bytes:
        return caption, None
    cut = data[:max_bytes].decode("utf-8", errors="ignore")
    return cut, (f"caption truncated: {len(data):,} bytes over the {max_bytes:,} byte cap "
                 "(max_caption_bytes)")


def rows_to_tables(rows: Iterable[dict], max_rows: int = 64,
                   max_bytes: int = 64 << 20) -> Iterator[pa.Table]:
    """Group rows into Arrow tables bounded by row count and image bytes (bounded memory),
    each table's rows with their deferred reservations read (`read_reservations`)."""
    pending: list[dict] = []
    pending_bytes = 0
    for row in rows:
        pending.append(row)
        pending_bytes += row["n_bytes"] or 0
        if len(pending) >= max_rows or pending_bytes >= max_bytes:
            read_reservations(pending)
            yield pa.Table.from_pylist(pending, schema=RAW_IMAGES_SCHEMA)
            pending, pending_bytes = [], 0
    if pending:
        read_reservations(pending)
        yield pa.Table.from_pylist(pending, schema=RAW_IMAGES_SCHEMA)
