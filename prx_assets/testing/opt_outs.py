"""Opt-out requests and the tables they resolve against, for the opt-out tests."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa

from prx_assets.stages.opt_outs.resolution import Resolution, resolve_opt_outs
from prx_assets.storage.lance_tables import overwrite_rows
from prx_assets.storage.layout import as_storage
from prx_assets.storage.tables import OPT_OUTS, RAW_IMAGES


def write_raw_ids(root: Path, source: str, ids: list[str]) -> None:
    """The key columns of raw_images that opt-out requests resolve against."""
    rows = pa.table({"id": ids, "source": [source] * len(ids),
                     "source_key": [i.split(":", 1)[1] for i in ids]})
    overwrite_rows(as_storage(root).table(RAW_IMAGES, source), rows, rows.schema)


def opt_out(root: Path, name: str, sample_id: str) -> None:
    """A request file dropped in the folder (the file door), opting one id out."""
    folder = as_storage(root).opt_outs_dir.path
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps({"key_type": "id", "value": sample_id,
                                           "timestamp": "2026-11-01T00:00:00Z",
                                           "reference": "ticket"}) + "\n")


def record_opt_outs(root: Path, sources: list[str] | None = None) -> Resolution:
    """What the `opt_outs` asset does: resolve, and write the result as the audited table
    (its record in the schema)."""
    storage = as_storage(root)
    resolved = resolve_opt_outs(storage, sources)
    overwrite_rows(storage.table(OPT_OUTS), resolved.audit, resolved.schema)
    return resolved
