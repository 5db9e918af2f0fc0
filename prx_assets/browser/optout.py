"""Opt-out requests from the browser, written through the pipeline's own mechanism.

A request becomes one new file in `$PRX_DATA_ROOT/opt_outs/` in the format the `opt_outs`
asset, `skip_lists` and `opt_out_sensor` already read (`key_type`, `value`, `timestamp`,
`reference`), so the audit trail, the skip lists and the sensor treat it like any other
request. One file per request: a new file is a new request for the sensor's cursor, and
writing it (`Location.write_text`: a hidden temporary file renamed into place, or one PUT on
S3) can never tear a file another process reads.

Who may write is decided in `browser.auth` (an authenticated curator, same origin, the
session's form token, within the curator's rate limit); each request line records the
curator (`requested_by`) and the door (`browser`), which the `opt_outs` audit table keeps.
The CLI (`prx-assets opt-out`) writes its requests through `write_requests` too.
"""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from pathlib import Path

from prx_assets.stages.opt_outs.opt_outs import OptOutRequest, parse_request
from prx_assets.storage.layout import Storage, as_storage
from prx_assets.storage.refs import Location

MAX_REFERENCE = 500
REQUEST_PREFIX, REQUEST_SUFFIX = "browser-", ".jsonl"


def write_request(storage: Storage | str | Path, sample_id: str, reference: str,
                  now: datetime | None = None, *, requested_by: str | None = None,
                  door: str = "browser") -> Location:
    """A new request file opting `sample_id` out; returns its location."""
    return write_requests(storage, [sample_id], reference, now, requested_by=requested_by,
                          door=door)


def write_requests(storage: Storage | str | Path, sample_ids: list[str], reference: str,
                   now: datetime | None = None, *, requested_by: str | None = None,
                   door: str = "browser") -> Location:
    """One new request file opting every id out (one line each, who and why on each);
    returns its location. Each record is checked with the pipeline's parser before
    anything is written, so what lands is valid; the write is durable (file and folder
    flushed) and whole (renamed into place, or one PUT)."""
    if not sample_ids:
        raise ValueError("no sample id to opt out")
    now = now or datetime.now(UTC)
    reference = " ".join(str(reference or "").split())[:MAX_REFERENCE] or f"corpus {door}"
    who = {"requested_by": requested_by, "door": door} if requested_by else {"door": door}
    records = [{"key_type": "id", "value": sample_id, "timestamp": now.isoformat(),
                "reference": reference, **who} for sample_id in sample_ids]
    digest = hashlib.sha256("\n".join([*sample_ids, now.isoformat()]).encode()
                            ).hexdigest()[:10]
    name = f"{door}-{now:%Y%m%dT%H%M%S}-{digest}{REQUEST_SUFFIX}"
    body = "".join(json.dumps(record) + "\n" for record in records)
    for line, record in enumerate(records, start=1):
        parse_request(record, name, line)  # ValueError naming what would be malformed
    target = as_storage(storage).opt_outs_dir / name
    target.write_text(body)
    return target


def pending_requests(storage: Storage | str | Path, sample_id: str, limit: int = 20
                     ) -> list[str]:
    """Browser request files naming this sample (so the page can say it was requested)."""
    found = []
    for location in as_storage(storage).opt_outs_dir.files(REQUEST_SUFFIX):
        if not location.name.startswith(REQUEST_PREFIX):
            continue
        try:
            requests = _requests_in(location.read_text(), location.name)
        except (FileNotFoundError, UnicodeDecodeError):
            continue  # removed since the listing, or not text: names nothing
        if any(r.key_type == "id" and r.value == sample_id for r in requests):
            found.append(location.name)
            if len(found) >= limit:
                break
    return found


def _requests_in(text: str, name: str) -> list[OptOutRequest]:
    """The valid requests of a browser request file (JSON lines), each record read by the
    pipeline's own `parse_request`, as the `opt_outs` asset reads it; a malformed line
    names nothing."""
    requests = []
    for line, raw in enumerate(text.splitlines(), start=1):
        try:
            record = json.loads(raw)
            if isinstance(record, dict):
                requests.append(parse_request(record, name, line))
        except ValueError:
            continue
    return requests
