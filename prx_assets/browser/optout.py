"""Opt-out requests from the browser, written through the pipeline's own mechanism.

A request becomes one new file in `$PRX_DATA_ROOT/opt_outs/` in the format the `opt_outs`
asset, `skip_lists` and `opt_out_sensor` already read (`key_type`, `value`, `timestamp`,
`reference`), so the audit trail, the skip lists and the sensor treat it like any other
request. One file per request: a new file is a new request for the sensor's cursor, and
writing it (`Location.write_text`: a hidden temporary file renamed into place, or one PUT on
S3) can never tear a file another process reads.

The page token is an HMAC of the sample id under a secret held by the server process, so a
POST is only accepted from a page that server rendered for that sample.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from datetime import UTC, datetime
from pathlib import Path

from prx_assets.stages.opt_outs.opt_outs import OptOutRequest, parse_request
from prx_assets.storage.layout import Storage, as_storage
from prx_assets.storage.refs import Location

MAX_REFERENCE = 500
REQUEST_PREFIX, REQUEST_SUFFIX = "browser-", ".jsonl"


class Tokens:
    def __init__(self, secret: bytes | None = None):
        self._secret = secret or secrets.token_bytes(32)

    def token(self, sample_id: str) -> str:
        return hmac.new(self._secret, f"opt-out:{sample_id}".encode(), hashlib.sha256).hexdigest()

    def valid(self, sample_id: str, token: str) -> bool:
        return hmac.compare_digest(self.token(sample_id), str(token or ""))


def write_request(storage: Storage | str | Path, sample_id: str, reference: str,
                  now: datetime | None = None) -> Location:
    """A new request file opting `sample_id` out; returns its location. The record is
    checked with the pipeline's parser before it is written, so what lands is valid."""
    now = now or datetime.now(UTC)
    reference = " ".join(str(reference or "").split())[:MAX_REFERENCE] or "corpus browser"
    record = {"key_type": "id", "value": sample_id, "timestamp": now.isoformat(),
              "reference": reference}
    digest = hashlib.sha256(f"{sample_id}\n{now.isoformat()}".encode()).hexdigest()[:10]
    name = f"{REQUEST_PREFIX}{now:%Y%m%dT%H%M%S}-{digest}{REQUEST_SUFFIX}"
    body = json.dumps(record) + "\n"
    parse_request(json.loads(body), name, 1)  # ValueError naming what would be malformed
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
