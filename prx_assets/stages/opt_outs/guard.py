"""Fail closed: the opt-outs recorded so far, where they sit in a source's current tree, and
which of them a reader could still stream.

The sidecars (`skip_lists`) are the fast path; this module is the defence behind them. The
training loader drops every recorded opt-out it finds in the trees it opens even when a
sidecar is missing or stale, and the `opt_outs_applied` check names the opt-outs that the
sidecars of the current tree do not skip yet, and the samples withheld for their rights
(`rights.withheld_ids`) that they do not skip as `rights`. "Recorded" means every request file in
`Storage.opt_outs_dir` (the browser, the CLI and file drops all write one), as
`resolve_opt_outs` gives it to every reader: from the audited `opt_outs` table, and a
request the table does not hold yet resolved on the fly (so it blocks its id all the same).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime

import pyarrow as pa
import pyarrow.compute as pc

from prx_assets.stages.opt_outs.resolution import resolve_opt_outs
from prx_assets.stages.opt_outs.rights import Withheld
from prx_assets.storage.layout import Storage
from prx_assets.storage.refs import Location
from prx_assets.storage.sidecars import REASON_OPTOUT, REASON_RIGHTS, read_sidecar, sidecar_name
from prx_assets.storage.tables import MDS_SAMPLES
from prx_assets.storage.trees import tree_store

SCAN_ROWS = 1 << 18


@dataclass(frozen=True)
class OptedOut:
    """One opted-out id and the earliest request that removed it. `requested_at` is when
    the pipeline learned of it: the request's own timestamp, or the time its file landed
    in the folder if later (a file dropped today may carry last month's date)."""

    id: str
    requested_at: datetime
    request_id: str


@dataclass(frozen=True)
class Place:
    """Where a sample is stored in its source's current tree."""

    id: str
    leaf: str  # relative to the tree, e.g. 512/512x512
    shard: str  # e.g. shard.00000.mds
    sample_index: int


def recorded_opt_outs(storage: Storage, sources: Iterable[str] | None = None
                      ) -> dict[str, OptedOut]:
    """Every id the request files recorded up to now remove, with its earliest request.
    `sources`: those whose raw_images resolve the requests (`resolve_opt_outs`' default:
    every source with a raw_images table)."""
    audit = resolve_opt_outs(storage, sources).audit
    if not audit.num_rows:
        return {}
    landed = landed_at(storage.opt_outs_dir)
    found: dict[str, OptedOut] = {}
    for row in audit.to_pylist():
        sample_id = row["id"]
        if sample_id is None:
            continue
        stamp = max(row["requested_at"], landed.get(row["file"], row["requested_at"]))
        known = found.get(sample_id)
        if known is None or stamp < known.requested_at:
            found[sample_id] = OptedOut(sample_id, stamp, row["request_id"])
    return found


def landed_at(folder: Location) -> dict[str, datetime]:
    """When each file of the folder was last written (its modification time, UTC)."""
    import pyarrow.fs as pafs

    fs, path = folder.filesystem()
    infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    return {info.base_name: info.mtime.replace(tzinfo=UTC) if info.mtime.tzinfo is None
            else info.mtime.astimezone(UTC)
            for info in infos if info.type == pafs.FileType.File and info.mtime is not None}


def places(storage: Storage, source: str, ids: Iterable[str]) -> list[Place]:
    """Where the mapping table of `source` stores each of `ids` (those of this source)."""
    wanted = sorted(i for i in ids if i.startswith(f"{source}:"))
    mapping = storage.table(MDS_SAMPLES, source)
    if not wanted or not mapping.exists():
        return []
    value_set = pa.array(wanted, pa.string())
    found: list[Place] = []
    scanner = mapping.open().scanner(columns=["id", "leaf", "shard", "sample_index"],
                                     batch_size=SCAN_ROWS)
    for batch in scanner.to_batches():
        rows = batch.filter(pc.fill_null(pc.is_in(batch.column("id"), value_set=value_set),
                                         False))
        found += [Place(r["id"], r["leaf"], r["shard"], int(r["sample_index"]))
                  for r in rows.to_pylist()]
    return found


@dataclass(frozen=True)
class Pending:
    """An opt-out the current tree's sidecars do not skip: still streamable."""

    opted: OptedOut
    place: Place


def pending_opt_outs(storage: Storage, source: str, opted: dict[str, OptedOut],
                     recorded_before: datetime) -> list[Pending]:
    """Opt-outs recorded before `recorded_before` that a reader of the source's current
    tree would still stream (no `optout` entry in their shard's sidecar), oldest first."""
    due = [o.id for o in opted.values() if o.requested_at <= recorded_before]
    pending = [Pending(opted[place.id], place)
               for place in unskipped(storage, source, due, REASON_OPTOUT)]
    return sorted(pending, key=lambda p: (p.opted.requested_at, p.place.id))


def pending_rights(storage: Storage, source: str, withheld: Mapping[str, Withheld]
                   ) -> list[tuple[Withheld, Place]]:
    """Samples withheld for their rights (`rights.withheld_ids`) that a reader of the
    source's current tree would still stream (no `rights` entry in their shard's sidecar),
    by id."""
    found = unskipped(storage, source, withheld, REASON_RIGHTS)
    return sorted(((withheld[p.id], p) for p in found), key=lambda pair: pair[1].id)


def unskipped(storage: Storage, source: str, ids: Iterable[str], reason: str) -> list[Place]:
    """The places of `ids` in the source's current tree whose shard's sidecar does not
    list them under `reason`."""
    located = places(storage, source, ids)
    if not located:
        return []
    tree = tree_store(storage, source).current_tree()
    sidecars: dict[tuple[str, str], set[int]] = {}
    found = []
    for place in located:
        key = (place.leaf, place.shard)
        if key not in sidecars:
            lists = read_sidecar(tree / place.leaf / sidecar_name(place.shard))
            sidecars[key] = set(lists.get(reason, ()))
        if place.sample_index not in sidecars[key]:
            found.append(place)
    return found
