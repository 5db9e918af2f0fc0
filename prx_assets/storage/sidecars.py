"""Skip sidecars: the file beside each MDS shard that tells the loader which of its samples
to leave out, and the reasons they name.

Beside each shard `shard.NNNNN.mds` of an MDS leaf sits `shard.NNNNN.skip.json`:

    {"version": 1, "lists": {"<reason>": [sorted shard-local sample indices], ...}}

An absent sidecar means nothing is skipped. Reasons are `dedup`, `semdedup` (embedding-space
duplicates), `text`, `nsfw` (and any other caption label chosen), `optout`, `stale` (written
by mds_shards itself): applied by the loader by default (DEFAULT_REASONS); and the opt-in
ones, applied only when a run names them: `balance` (the samples concept balancing leaves
out) and one per named ablation list.

A sidecar is replaced whole (`Location.write_text`: locally a temporary file renamed over
it, on S3 one PUT), so a reader sees the old lists or the new ones, never half a file.

The skip_lists stage writes sidecars, mds_shards carries them and writes `stale`, and the
training loader, the browser and the opt-out guard read them: all through this module,
which imports neither Ray nor mosaicml-streaming.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path, PurePath

from prx_assets.storage.refs import Location, as_location

SIDECAR_VERSION = 1
SHARD_SUFFIX = ".mds"
SIDECAR_SUFFIX = ".skip.json"
REASON_DEDUP, REASON_OPTOUT = "dedup", "optout"
REASON_SEMDEDUP, REASON_BALANCE = "semdedup", "balance"
REASON_RIGHTS = "rights"  # samples without the rights to train on (a reason to come)
# Caption labels a skip list may name (`SkipListsConfig.skip_labels`): the labels stage's
# LABELS, spelled out here because the training loader imports this module and not that one
# (a test keeps the two equal).
LABEL_REASONS = frozenset({"visual", "text", "nsfw"})
# Samples an incremental mds_shards run superseded (the id changed or left the source): still
# stored in an older shard, written by mds_shards itself, always applied by the loader and
# kept by the skip_lists asset whatever it is configured with; a rewrite drops them.
REASON_STALE = "stale"
# The one definition of what the loader skips when a run names no reasons: hygiene (exact
# and semantic duplicates, caption labels, opt-outs, rights) and stale samples. Every other
# reason is opt-in, applied only when a run names it: `balance` and each named ablation list
# change the data mix, which is an experiment, not hygiene. The grid, the sample page, the
# funnel, the cards and the skipped_share check count skips with this same test.
DEFAULT_REASONS = frozenset({REASON_DEDUP, REASON_SEMDEDUP, REASON_OPTOUT, REASON_RIGHTS,
                             REASON_STALE}) | LABEL_REASONS


def applies_by_default(reason: str) -> bool:
    """Whether the loader applies `reason` when a run names none (see DEFAULT_REASONS)."""
    return reason in DEFAULT_REASONS


def by_default(lists: Mapping[str, list[int]]) -> dict[str, list[int]]:
    """The lists the loader applies by default."""
    return {reason: ids for reason, ids in lists.items() if applies_by_default(reason)}


def opt_in(lists: Mapping[str, list[int]]) -> dict[str, list[int]]:
    """The opt-in lists (`balance`, named ablations): applied only when a run names them."""
    return {reason: ids for reason, ids in lists.items() if not applies_by_default(reason)}


def sidecar_name(shard_name: str) -> str:
    """`shard.00003.mds` -> `shard.00003.skip.json`."""
    return shard_name.removesuffix(SHARD_SUFFIX) + SIDECAR_SUFFIX


def shard_name_of(sidecar: str) -> str:
    """`shard.00003.skip.json` -> `shard.00003.mds`."""
    return sidecar.removesuffix(SIDECAR_SUFFIX) + SHARD_SUFFIX


def sidecar_path(shard_path: str | PurePath) -> Path:
    """The sidecar beside a local shard."""
    shard_path = Path(shard_path)
    return shard_path.with_name(sidecar_name(shard_path.name))


def read_sidecar(sidecar: Location | str | PurePath) -> dict[str, list[int]]:
    """The skip lists of one shard by reason; {} when the sidecar does not exist. A path or
    URI is read with the standard settings, a Location with its own. (The training loader
    reads sidecars through this function.)"""
    try:
        data = json.loads(as_location(sidecar).read_text())
    except FileNotFoundError:
        return {}
    if data.get("version") != SIDECAR_VERSION:
        raise ValueError(f"{sidecar}: unsupported skip sidecar version {data.get('version')!r}")
    return {str(reason): [int(i) for i in indices] for reason, indices in data["lists"].items()}


def sidecar_body(lists: Mapping[str, Iterable[int]]) -> str | None:
    """A sidecar's JSON text, None when nothing is skipped (no sidecar at all)."""
    clean = {reason: sorted({int(i) for i in ids}) for reason, ids in sorted(lists.items())}
    clean = {reason: ids for reason, ids in clean.items() if ids}
    if not clean:
        return None
    return json.dumps({"version": SIDECAR_VERSION, "lists": clean}, separators=(",", ":"))


def write_sidecar(sidecar: Location | str | PurePath, lists: Mapping[str, Iterable[int]]
                  ) -> None:
    """Replace the sidecar whole (readers see the old lists or the new ones); empty lists
    remove it (absent = nothing skipped)."""
    location = as_location(sidecar)
    body = sidecar_body(lists)
    if body is None:
        location.delete()
    else:
        location.write_text(body)


def skipped_indices(lists: Mapping[str, list[int]], reasons: Iterable[str] | None = None
                    ) -> set[int]:
    """The union of the selected reasons (all of them by default): what the loader skips."""
    chosen = lists if reasons is None else {r: lists.get(r, []) for r in reasons}
    return {i for ids in chosen.values() for i in ids}


def sidecar_files(tree: Path) -> list[Path]:
    """Every sidecar under a local tree."""
    return sorted(Path(tree).rglob(f"*{SIDECAR_SUFFIX}"))


def tree_sidecars(tree: Location) -> list[Location]:
    """Every sidecar of a tree (`<tier>/<W>x<H>/*.skip.json`), local or on an object store:
    one listing per tier and per leaf."""
    return [sidecar for tier in tree.folders() for shape in (tree / tier).folders()
            for sidecar in (tree / tier / shape).files(SIDECAR_SUFFIX)]
