"""The stages that read a source's active captions (labels, attributes): what they share.

Each writes rows under a pair (the caption version, its own version), records the captions
it consumed under that pair, and is handed the captions written since its record: those are
looked up by id in its table (a +1 caption run never compares every caption with every row);
without a record (a first run, a new version) it compares in full, its own way
(`pending_in_full`).
"""

from __future__ import annotations

import pyarrow as pa
import ray.data

from prx_assets.engine.chunked import drop_ids
from prx_assets.engine.removals import delete_ids
from prx_assets.engine.stage import Pending, R, Stage
from prx_assets.storage.changes import handed_changes, not_up_to_date, read_ids
from prx_assets.storage.refs import TableRef

CAPTION_COLUMNS = ["id", "caption_version", "caption"]
LOOKUP_CAPTIONS = 10_000  # changed captions looked up by id; past it, compared in full


def record_tag(caption_version: str, version: str) -> str:
    """What a consumer's record of the captions was made under: the active pair."""
    return f"{caption_version}/{version}"


class CaptionConsumer(Stage[R]):
    """A stage over the usable captions of the active caption version (`caption_filter`)
    under (caption version, `version`). Subclasses say which of their rows are final under
    the pair (`done_filter`) and how they compare in full (`pending_in_full`);
    `drops_removed` says whether rows of captions gone upstream are deleted."""

    upstream = "captions"  # what the consumer's record of the captions is called
    drops_removed = False

    def __init__(self, caption_version: str, caption_filter: str, version: str):
        self.caption_version, self.caption_filter = caption_version, caption_filter
        self.pair = (caption_version, version)

    def record_tag(self) -> str:
        return record_tag(*self.pair)

    def done_filter(self) -> str:
        raise NotImplementedError

    def pending_in_full(self, captions: TableRef, target: TableRef) -> Pending:
        raise NotImplementedError

    def pending(self, upstream: TableRef, target: TableRef, report: R) -> Pending:
        changed = handed_changes(upstream, target, self.upstream, self.record_tag(),
                                 self.caption_filter, LOOKUP_CAPTIONS)
        if changed is None:
            return self.pending_in_full(upstream, target)
        added, removed = changed
        dropped = delete_ids(target.latest(), removed) if self.drops_removed else 0
        todo = not_up_to_date(added, target, self.done_filter(), upstream, self.caption_filter)
        return Pending(len(todo), self.read(upstream, todo), dropped)

    def read(self, captions: TableRef, ids: pa.Array) -> ray.data.Dataset | None:
        """The usable caption rows of these ids (None: none, nothing is built)."""
        return read_ids(captions, ids, CAPTION_COLUMNS, self.caption_filter)

    def read_all_but(self, captions: TableRef, done: pa.Array, count: int) -> Pending:
        """The `count` usable captions whose id is not in `done` (nothing read when none)."""
        return Pending(count, drop_ids(captions.read(columns=CAPTION_COLUMNS,
                                                     filter=self.caption_filter), done)
                       if count else None)
