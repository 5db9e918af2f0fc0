"""How long superseded versions of a table stay readable.

Metadata tables keep every version for `FragmentPolicy.keep_versions` (7 days: lineage
reads old versions). Tables holding blobs cannot: after a compaction the superseded
fragments are the table's whole size again, which the 7-day retention would hold for a
week (~300 TB per table at 10⁹ images). Their versions are freed once they have been
superseded for a short grace instead (`FragmentPolicy.superseded_grace`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta
from itertools import pairwise
from typing import Any

import lance

from prx_assets.storage.refs import TableRef

# Tables holding blobs (images): how long a version superseded by a compaction or a
# rewrite stays readable, so a reader that pinned it just before keeps working; its files
# are freed by the first cleanup after that (`PRX_BLOB_GRACE_S` overrides). The 7-day
# retention of metadata tables would hold a blob table's whole size twice for a week.
DEFAULT_BLOB_GRACE = timedelta(minutes=10)


def blob_grace() -> timedelta:
    """The grace of superseded blob-table versions: `PRX_BLOB_GRACE_S` seconds if set."""
    seconds = os.environ.get("PRX_BLOB_GRACE_S")
    return timedelta(seconds=float(seconds)) if seconds else DEFAULT_BLOB_GRACE


def superseded_versions(versions: Sequence[Mapping[str, Any]], grace: timedelta,
                        now: datetime) -> list[int]:
    """The versions whose successor was committed at least `grace` before `now`: whoever
    pinned one did so while it was the latest, more than `grace` ago."""
    ordered = sorted(versions, key=lambda v: v["version"])
    return [v["version"] for v, after in pairwise(ordered)
            if after["timestamp"] <= now - grace]


def drop_superseded(table: lance.LanceDataset, grace: timedelta) -> int:
    """Free the files only versions superseded `grace` ago or earlier reference (a
    compaction's inputs, a rewrite's old rows); returns the bytes removed. A reader still
    on such a version gets `VersionRemovedError` from `TableRef`."""
    # Lance's timestamps are naive local times (`datetime.fromtimestamp`).
    gone = superseded_versions(table.versions(), grace, datetime.now())
    if not gone:
        return 0
    return table.cleanup_old_versions(versions=gone, error_if_tagged_old_versions=False
                                      ).bytes_removed


HOLD_TAG_PREFIX = "prx-held-by-"


def hold_version(table: TableRef, holder: str, version: int) -> None:
    """Keep `version` of `table`, and its files, until `holder` holds another: cleanups
    skip tagged versions. For a stage that compares the version it last read with a later
    one (captions: which items changed), whatever the table's grace."""
    dataset = table.latest().open()
    tag = HOLD_TAG_PREFIX + holder
    held = dataset.tags.list().get(tag)
    if held is None:
        dataset.tags.create(tag, version)
    elif held["version"] != version:
        dataset.tags.update(tag, version)


def release_version(table: TableRef, holder: str) -> None:
    """Let the version `holder` holds go (the next cleanup may free it)."""
    dataset = table.latest().open()
    tag = HOLD_TAG_PREFIX + holder
    if tag in dataset.tags.list():
        dataset.tags.delete(tag)


@contextmanager
def held_while(table: TableRef, holder: str, version: int | None) -> Iterator[None]:
    """Keep `version` of `table` readable while the block runs, however it ends: a run
    reading a pinned version of a blob table for longer than its grace (hours of GPU
    captioning) would otherwise lose it to the next cleanup."""
    if version is None:
        yield
        return
    hold_version(table, holder, version)
    try:
        yield
    finally:
        release_version(table, holder)
