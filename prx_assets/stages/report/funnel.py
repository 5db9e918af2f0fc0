"""Where a source's images go: one count per stage, read back from the stored tables.

Counted from what is on disk (not from the last run's metadata), so an incremental rerun
that skipped a stage still reports the whole source. Each count is a Lance `count_rows`
with a filter, or a pass over the skip sidecars: nothing is loaded whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from prx_assets.stages.captions.captions import active_caption_filter
from prx_assets.stages.images.buckets import STATUS_BAD_ASPECT, STATUS_TOO_SMALL
from prx_assets.stages.labels.labels import active_labels_filter
from prx_assets.stages.skip_lists.skip_lists import SkipTally, duplicate_ids, tree_skips
from prx_assets.storage.filters import in_filter
from prx_assets.storage.layout import Storage, as_storage
from prx_assets.storage.refs import Location
from prx_assets.storage.tables import (
    BUCKETED_IMAGES,
    CAPTION_LABELS,
    CAPTIONS,
    DUPLICATES,
    MDS_SAMPLES,
    RAW_IMAGES,
)
from prx_assets.storage.trees import tree_store

# Image-stage statuses of rows that decoded (the filter's reasons); any other non-ok
# status is a file that could not be read as an image.
DECODED_STATUSES = ("ok", STATUS_TOO_SMALL, STATUS_BAD_ASPECT)


@dataclass(frozen=True)
class Funnel:
    source: str
    raw: int
    decodable: int
    kept: int
    captioned: int
    labelled: int
    duplicates: int
    skipped: int
    in_shards: int
    # Samples per opt-in list (`balance`, ablations): not skipped unless a run names them,
    # so outside the funnel's rows; shown beside them.
    opt_in: dict[str, int] = field(default_factory=dict)

    def rows(self) -> list[tuple[str, int]]:
        return [("raw", self.raw), ("decodable", self.decodable), ("kept by the filter", self.kept),
                ("captioned", self.captioned), ("labelled", self.labelled),
                ("duplicates", self.duplicates), ("skipped", self.skipped),
                ("samples in shards", self.in_shards), ("streamed by loader", self.streamed)]

    @property
    def streamed(self) -> int:
        """What the loader yields: samples in shards minus the skipped ones."""
        return self.in_shards - self.skipped


def _count(storage: Storage, table: str, source: str | None,
           condition: str | None = None) -> int:
    ref = storage.table(table, source)
    return ref.count_rows(filter=condition) if ref.exists() else 0


def skipped_in_tree(tree: Location) -> int:
    """Samples the sidecars skip for the reasons the loader applies by default (not the
    opt-in `balance` and ablation lists; a sample skipped for two reasons counts once);
    `tree` is a local folder or a version's `s3://` prefix."""
    return tree_skips(tree).skipped


def source_funnel(storage: Storage | str | Path, source: str, caption_version: str,
                  classifier_version: str) -> Funnel:
    storage = as_storage(storage)
    try:
        skips = tree_skips(tree_store(storage, source).current_tree())
    except FileNotFoundError:  # no shards written yet
        skips = SkipTally()
    return Funnel(
        source=source,
        raw=_count(storage, RAW_IMAGES, source),
        decodable=_count(storage, BUCKETED_IMAGES, source,
                         in_filter("status", DECODED_STATUSES)),
        kept=_count(storage, BUCKETED_IMAGES, source, "status = 'ok'"),
        captioned=_count(storage, CAPTIONS, source, active_caption_filter(caption_version)),
        labelled=_count(storage, CAPTION_LABELS, source,
                        active_labels_filter(caption_version, classifier_version)),
        duplicates=len(duplicate_ids(storage.table(DUPLICATES), source)),
        skipped=skips.skipped,
        in_shards=_count(storage, MDS_SAMPLES, source),
        opt_in=dict(sorted(skips.opt_in.items())),
    )


def format_funnel(funnel: Funnel) -> list[str]:
    """Aligned lines: count, and the share of the raw rows; then the opt-in lists."""
    lines = []
    for name, count in funnel.rows():
        share = f"{count / funnel.raw:6.1%}" if funnel.raw else "     -"
        lines.append(f"   {name:<20} {count:>9,}  {share}")
    if funnel.opt_in:
        lines.append(f"   {opt_in_words(funnel.opt_in)}")
    return lines


def opt_in_words(opt_in: dict[str, int]) -> str:
    """"opt-in, not skipped unless a run names it: balance 45" (the opt-in lists' sizes)."""
    lists = ", ".join(f"{reason} {n:,}" for reason, n in sorted(opt_in.items()))
    it = "it" if len(opt_in) == 1 else "them"
    return f"opt-in, not skipped unless a run names {it}: {lists}"
