"""What a source sensor compares between ticks: a digest of the source's listing.

A source changes when a unit is added, removed, or rewritten; what a listing says of each
unit (its name and `unit_signature`: size and mtime, or a Lance table's version) is exactly
what an ingest run compares with its table. So the digest of the listing, in the order the
walk yields it, changes when and only when an ingest run would find something to do.

Why not something cheaper, like the listing's count and newest mtime: a file removed while
another is added keeps the count, and a file copied in with its old mtime preserved (`cp -p`,
`rsync -t`, an S3 copy of an old object) keeps the newest mtime; either would go unseen.
A listing is the least an honest check costs without an event feed; what the digest adds
is one hash update per unit, and the cursor stays a few dozen bytes whatever the bucket
holds (`bench/source_sensor.py` measures the tick against a bare listing).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from prx_assets.stages.ingest.listing import list_source, resolve_location
from prx_assets.stages.ingest.location import SourceLocation
from prx_assets.stages.ingest.sources import SourceSpec


@dataclass(frozen=True)
class ListingDigest:
    """The units a listing found and the digest of (unit, signature) over all of them."""

    units: int
    digest: str

    def to_cursor(self) -> str:
        return json.dumps({"units": self.units, "digest": self.digest})

    @classmethod
    def from_cursor(cls, cursor: str | None) -> ListingDigest | None:
        if not cursor:
            return None
        value = json.loads(cursor)
        return cls(int(value["units"]), str(value["digest"]))


def listing_digest(spec: SourceSpec, uri: str | Path | SourceLocation) -> ListingDigest:
    """Digest the source's listing, streaming (nothing per unit is held). Raises what the
    listing raises (`listing.ListingError`, `listing.SourceNotFoundError`): an incomplete
    listing must not pass for a changed source."""
    digest = hashlib.blake2b(digest_size=16)
    units = 0
    for unit, signature in list_source(spec, resolve_location(spec, uri)):
        # NUL cannot occur in a path: the pairs cannot run into each other.
        digest.update(f"{unit}\0{signature}\0".encode())
        units += 1
    return ListingDigest(units, digest.hexdigest())


def change_reason(before: ListingDigest | None, now: ListingDigest) -> str | None:
    """Why the source needs an ingest run (None when the listing is the same)."""
    if before is None:
        return f"first listing seen by this sensor: {now.units:,} unit(s)"
    if before == now:
        return None
    if before.units == now.units:
        return f"listing changed: {now.units:,} unit(s), some added, removed or rewritten"
    return f"listing changed: {before.units:,} -> {now.units:,} unit(s)"
