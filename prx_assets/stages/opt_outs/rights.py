"""Rights reservations as every reader applies them: which samples skip reason `rights`
withholds, from the reservations ingest recorded in `raw_images`, the domain list and the
curators' clearances of now.

    raw_images.reservation    "prohibited": withheld; "constrained": withheld until cleared
    raw_images.url            withheld when a listed domain or URL prefix covers it
    rights/domains/*.txt      the domain list (re-read by every reader: no re-ingest)
    rights/clearances/*.jsonl a curator's clearance of a constrained sample: the opt-out
                              request format and writer (`requests.write_requests`), so
                              it is audited like an opt-out (who, when, why, which door)

Readers: the skip_lists asset (reason `rights`), the loader's guard (fail closed: the
sidecars are not trusted for these either) and the browser (badge, facet, sample page). A
clearance never lifts a prohibition, and nothing here lifts an opt-out: reasons are unioned.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from prx_assets.stages.ingest.rights import (
    CONSTRAINED,
    NONE,
    PROHIBITED,
    DomainList,
    parse_domain_list,
)
from prx_assets.stages.opt_outs.requests import parse_directory, write_requests
from prx_assets.storage.layout import Storage, as_storage
from prx_assets.storage.refs import Location, TableRef
from prx_assets.storage.tables import RAW_IMAGES

DOMAINS_DIR, CLEARANCES_DIR = "domains", "clearances"
RESERVATION_COLUMNS = ("id", "url", "reservation", "reservation_signal")
SCAN_ROWS = 1 << 18


@dataclass(frozen=True)
class Withheld:
    """A sample skip reason `rights` withholds, and why."""

    id: str
    status: str  # prohibited, or constrained (not cleared)
    signal: str


@dataclass(frozen=True)
class RightsRules:
    """The domain list and the cleared ids, read once per reader."""

    domains: DomainList = field(default_factory=DomainList)
    cleared: frozenset[str] = frozenset()

    def withheld(self, sample_id: str, reservation: str | None, signal: str | None,
                 url: str | None) -> Withheld | None:
        """Why the sample is withheld, None when it is not."""
        if reservation == PROHIBITED:
            return Withheld(sample_id, PROHIBITED, signal or "")
        if url and self.domains:
            found = self.domains.findings(url)
            if found:
                return Withheld(sample_id, PROHIBITED, str(found[0]))
        if reservation == CONSTRAINED and sample_id not in self.cleared:
            return Withheld(sample_id, CONSTRAINED, signal or "")
        return None


def domains_dir(storage: Storage) -> Location:
    return storage.rights_dir / DOMAINS_DIR


def clearances_dir(storage: Storage) -> Location:
    return storage.rights_dir / CLEARANCES_DIR


def read_rules(storage: Storage | str | Path) -> RightsRules:
    storage = as_storage(storage)
    text = "\n".join(f.read_text() for f in domains_dir(storage).files(".txt"))
    return RightsRules(parse_domain_list(text), frozenset(cleared_ids(storage)))


def rules_fingerprint(storage: Storage | str | Path) -> str:
    """A hash of the domain lists and clearance files as they are now: what the rights
    sensor compares (a file added, rewritten or removed changes it)."""
    storage = as_storage(storage)
    digest = hashlib.sha256()
    for folder in (domains_dir(storage), clearances_dir(storage)):
        for file in sorted(folder.files(), key=lambda f: f.name):
            if file.name.startswith("."):
                continue
            digest.update(f"{folder.name}/{file.name}\0".encode())
            digest.update(hashlib.sha256(file.read_bytes()).digest())
    return digest.hexdigest()[:16]


def cleared_ids(storage: Storage) -> set[str]:
    """Ids a curator cleared (malformed rows clear nothing)."""
    return {r.value for r in parse_directory(clearances_dir(storage)).requests
            if r.key_type == "id"}


def clear(storage: Storage | str | Path, sample_ids: list[str], reference: str, *,
          door: str, cleared_by: str | None = None, now: datetime | None = None) -> Location:
    """Record a curator's clearance of constrained samples (one new audited file)."""
    storage = as_storage(storage)
    return write_requests(storage, sample_ids, reference, now, door=door,
                          requested_by=cleared_by, folder=clearances_dir(storage))


def withheld_rows(raw: TableRef, rules: RightsRules) -> Iterator[Withheld]:
    """Every sample of a source's raw_images the rules withhold. A table written before
    reservations were recorded has no such column: only the domain list applies to it
    until its next ingest rebuilds it."""
    if not raw.exists():
        return
    table = raw.open()
    columns = [c for c in RESERVATION_COLUMNS if c in table.schema.names]
    if "reservation" not in columns and not rules.domains:
        return
    # Without a domain list only the reserved rows matter: Lance filters the rest out.
    filter_ = None if rules.domains else f"reservation != '{NONE}'"
    for batch in table.scanner(columns=columns, filter=filter_,
                               batch_size=SCAN_ROWS).to_batches():
        yield from _withheld_in(batch, rules)


def _withheld_in(batch: pa.RecordBatch, rules: RightsRules) -> Iterator[Withheld]:
    def column(name: str) -> list:
        if name in batch.schema.names:
            return batch.column(name).to_pylist()
        return [None] * batch.num_rows

    for sample_id, url, reservation, signal in zip(
            column("id"), column("url"), column("reservation"),
            column("reservation_signal"), strict=True):
        found = rules.withheld(sample_id, reservation, signal, url)
        if found is not None:
            yield found


def reservation_counts(raw: TableRef) -> dict[str, int]:
    """Rows of a raw_images table per `reservation` value (none, constrained, prohibited;
    {} for a table from before reservations)."""
    if "reservation" not in raw.open().schema.names:
        return {}
    column = raw.to_table(columns=["reservation"]).column("reservation")
    return {str(v["values"]): int(v["counts"])
            for v in pc.value_counts(column).to_pylist() if v["values"] is not None}


def withheld_ids(storage: Storage | str | Path, sources: Iterable[str],
                 rules: RightsRules | None = None) -> dict[str, Withheld]:
    """Every withheld sample of `sources`, by id."""
    storage = as_storage(storage)
    rules = rules if rules is not None else read_rules(storage)
    return {w.id: w for source in sources
            for w in withheld_rows(storage.table(RAW_IMAGES, source), rules)}
