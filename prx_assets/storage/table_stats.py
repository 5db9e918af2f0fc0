"""Summaries of a written table for asset metadata: counts and resolution bands.

Reads only small columns (never image bytes), batch by batch, so it stays cheap and
bounded on any table size.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import pyarrow.compute as pc

from prx_assets.storage.refs import TableRef

# Megapixel bands and aspect-ratio bands used for the resolution summary.
MP_BANDS = [(0, 0.25), (0.25, 0.5), (0.5, 1.0), (1.0, 2.0), (2.0, 4.0), (4.0, 12.0),
            (12.0, math.inf)]
AR_BANDS = [(0, 0.5), (0.5, 0.8), (0.8, 1.25), (1.25, 2.0), (2.0, math.inf)]


@dataclass
class TableProfile:
    rows: int = 0
    status_counts: Counter = field(default_factory=Counter)
    format_counts: Counter = field(default_factory=Counter)
    megapixel_bands: Counter = field(default_factory=Counter)
    aspect_bands: Counter = field(default_factory=Counter)
    image_bytes: int = 0

    @property
    def ok_rows(self) -> int:
        return self.status_counts.get("ok", 0)

    @property
    def not_ok_share(self) -> float:
        return 0.0 if self.rows == 0 else 1.0 - self.ok_rows / self.rows


def band_label(value: float, bands: list[tuple[float, float]], unit: str = "") -> str:
    for low, high in bands:
        if low <= value < high:
            return f"{low:g}–{high:g}{unit}" if high != math.inf else f"≥{low:g}{unit}"
    return "?"


def profile_table(ref: TableRef, batch_rows: int = 65_536) -> TableProfile:
    """Counts by status and format, and megapixel / aspect-ratio bands of ok rows."""
    table = ref.open()
    wanted = [c for c in ("status", "format", "width", "height", "n_bytes")
              if c in table.schema.names]
    profile = TableProfile()
    for batch in table.to_batches(columns=wanted, batch_size=batch_rows):
        columns = batch.to_pydict()
        profile.rows += batch.num_rows
        statuses = columns.get("status", ["ok"] * batch.num_rows)
        profile.status_counts.update(statuses)
        if "format" in columns:
            profile.format_counts.update(f for f in columns["format"] if f)
        if "n_bytes" in columns:
            profile.image_bytes += sum(n or 0 for n, s in zip(columns["n_bytes"], statuses,
                                                              strict=True) if s == "ok")
        if "width" in columns and "height" in columns:
            for w, h, s in zip(columns["width"], columns["height"], statuses, strict=True):
                if s == "ok" and w and h:
                    profile.megapixel_bands[band_label(w * h / 1e6, MP_BANDS, " MP")] += 1
                    profile.aspect_bands[band_label(w / h, AR_BANDS)] += 1
    return profile


@dataclass
class BucketProfile:
    rows: int = 0
    status_counts: Counter = field(default_factory=Counter)
    tier_counts: Counter = field(default_factory=Counter)
    shape_counts: Counter = field(default_factory=Counter)  # (tier, "WxH") -> count
    hashed: int = 0
    flat: int = 0

    @property
    def kept(self) -> int:
        return self.status_counts.get("ok", 0)

    @property
    def kept_share(self) -> float:
        return self.kept / self.rows if self.rows else 0.0


def bucket_profile(ref: TableRef, batch_rows: int = 65_536) -> BucketProfile:
    """Counts per status, tier and shape of a bucketed table (small columns only)."""
    profile = BucketProfile()
    table = ref.open()
    columns = ["status", "tier", "width", "height", "phash", "flat"]
    for batch in table.to_batches(columns=columns, batch_size=batch_rows):
        data = batch.to_pydict()
        profile.rows += batch.num_rows
        profile.status_counts.update(data["status"])
        for status, tier, w, h in zip(data["status"], data["tier"], data["width"], data["height"],
                                      strict=True):
            if status == "ok":
                profile.tier_counts[tier] += 1
                profile.shape_counts[(tier, f"{w}x{h}")] += 1
        profile.hashed += sum(p is not None for p in data["phash"])
        profile.flat += sum(bool(f) for f in data["flat"] if f is not None)
    return profile


def value_counts(ref: TableRef, column: str, filter: str | None = None,
                 batch_rows: int = 65_536) -> Counter:
    """How many rows matching `filter` hold each value of `column`: counted in Arrow batch
    by batch, so memory follows the distinct values (statuses, labels), not the rows."""
    counts: Counter = Counter()
    for batch in ref.open().to_batches(columns=[column], filter=filter, batch_size=batch_rows):
        for pair in pc.value_counts(batch.column(0)).to_pylist():
            counts[pair["values"]] += pair["counts"]
    return counts
