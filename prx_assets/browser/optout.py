"""Opt-out requests from the browser, written through the pipeline's own mechanism.

A request becomes one new file in `$PRX_DATA_ROOT/opt_outs/` in the format the `opt_outs`
asset, `skip_lists` and `opt_out_sensor` already read (`key_type`, `value`, `timestamp`,
`reference`), so the audit trail, the skip lists and the sensor treat it like any other
request. One file per request: a new file is a new request for the sensor's cursor, and
writing it (temporary hidden file, then rename) can never tear a file another process reads.

The page token is an HMAC of the sample id under a secret held by the server process, so a
POST is only accepted from a page that server rendered for that sample.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from prx_assets.s6_opt_outs.opt_outs import opt_out_dir, parse_file
from prx_assets.storage.layout import Storage

MAX_REFERENCE = 500


class Tokens:
    def __init__(self, secret: bytes | None = None):
        self._secret = secret or secrets.token_bytes(32)

    def token(self, sample_id: str) -> str:
        return hmac.new(self._secret, f"opt-out:{sample_id}".encode(), hashlib.sha256).hexdigest()

    def valid(self, sample_id: str, token: str) -> bool:
        return hmac.compare_digest(self.token(sample_id), str(token or ""))


def write_request(storage: Storage | str | Path, sample_id: str, reference: str,
                  now: datetime | None = None) -> Path:
    """A new request file opting `sample_id` out; returns its path. The file is parsed back
    with the pipeline's parser before it is moved into place, so what lands is valid."""
    now = now or datetime.now(timezone.utc)
    reference = " ".join(str(reference or "").split())[:MAX_REFERENCE] or "corpus browser"
    record = {"key_type": "id", "value": sample_id, "timestamp": now.isoformat(),
              "reference": reference}
    folder = opt_out_dir(storage)
    folder.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256(f"{sample_id}\n{now.isoformat()}".encode()).hexdigest()[:10]
    name = f"browser-{now:%Y%m%dT%H%M%S}-{digest}.jsonl"
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".browser-", suffix=".jsonl.tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
        check = parse_file(Path(tmp))
        if check.errors or len(check.requests) != 1:
            raise ValueError(f"opt-out request would be malformed: {check.errors}")
        target = folder / name
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def pending_requests(storage: Storage | str | Path, sample_id: str, limit: int = 20
                     ) -> list[str]:
    """Browser request files naming this sample (so the page can say it was requested)."""
    folder = opt_out_dir(storage)
    if not folder.is_dir():
        return []
    found = []
    for path in sorted(folder.glob("browser-*.jsonl")):
        parsed = parse_file(path)
        if any(r.key_type == "id" and r.value == sample_id for r in parsed.requests):
            found.append(path.name)
            if len(found) >= limit:
                break
    return found
