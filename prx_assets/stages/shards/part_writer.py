"""mosaicml-streaming's `MDSWriter` for one part: into the part's folder, or through a local
temporary folder with each shard uploaded to the part's `Location` as soon as it is flushed
(see `parts`). Its own module: importing streaming costs torch and transformers, which only
the processes writing parts pay."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from streaming import MDSWriter

from prx_assets.stages.shards.plan import MDS_COLUMNS, WriteOptions
from prx_assets.storage.refs import Location


class PartWriter(MDSWriter):
    """An MDSWriter into a local folder; with a `destination`, each shard is uploaded there
    as soon as it is flushed, then deleted locally. The part's index is not uploaded: the
    driver writes the leaf's index from the entries the task returns."""

    def __init__(self, *, destination: Location | None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.destination = destination

    def flush_shard(self) -> None:
        super().flush_shard()
        if self.destination is None:
            return
        entry = self.shards[-1]
        basename = (entry.get("zip_data") or entry["raw_data"])["basename"]
        written = Path(self.local) / basename
        (self.destination / basename).write_bytes(written.read_bytes())
        written.unlink()


@contextmanager
def part_writer(out: Location, options: WriteOptions) -> Iterator[MDSWriter]:
    """A writer for the part folder `out`: in place locally, through a local temporary
    folder (about one shard at a time) on an object store."""
    scratch = None if out.is_local else tempfile.mkdtemp(prefix="prx-mds-part-")
    try:
        with PartWriter(destination=None if scratch is None else out,
                        out=str(out.path) if scratch is None else f"{scratch}/part",
                        columns=MDS_COLUMNS, size_limit=options.size_limit,
                        compression=options.compression, exist_ok=True) as writer:
            yield writer
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
