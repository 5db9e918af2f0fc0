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

from prx_assets.stages.opt_outs.opt_outs import (
    Location, child, name_of, opt_out_dir, parse_file, request_files)
from prx_assets.storage import object_store
from prx_assets.storage.layout import Storage, as_storage

MAX_REFERENCE = 500


class Tokens:
    def __init__(self, secret: bytes | None = None):
        self._secret = secret or secrets.token_bytes(32)

    def token(self, sample_id: str) -> str:
        return hmac.new(self._secret, f"opt-out:{sample_id}".encode(), hashlib.sha256).hexdigest()

    def valid(self, sample_id: str, token: str) -> bool:
        return hmac.compare_digest(self.token(sample_id), str(token or ""))


def write_request(storage: Storage | str | Path, sample_id: str, reference: str,
                  now: datetime | None = None) -> Location:
    """A new request file opting `sample_id` out; returns its location. The file is parsed
    back with the pipeline's parser before it is moved into place, so what lands is valid.
    On an object store it is one put of the whole object (never visible half-written)."""
    now = now or datetime.now(timezone.utc)
    reference = " ".join(str(reference or "").split())[:MAX_REFERENCE] or "corpus browser"
    record = {"key_type": "id", "value": sample_id, "timestamp": now.isoformat(),
              "reference": reference}
    storage = as_storage(storage)
    folder = opt_out_dir(storage)
    digest = hashlib.sha256(f"{sample_id}\n{now.isoformat()}".encode()).hexdigest()[:10]
    name = f"browser-{now:%Y%m%dT%H%M%S}-{digest}.jsonl"
    if not isinstance(folder, Path):
        return _put_request(folder, name, record, storage.storage_options)
    folder.mkdir(parents=True, exist_ok=True)
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


def _put_request(folder: str, name: str, record: dict, storage_options) -> str:
    body = (json.dumps(record) + "\n").encode("utf-8")
    with tempfile.TemporaryDirectory() as scratch:  # checked with the pipeline's parser
        check_path = Path(scratch, name)
        check_path.write_bytes(body)
        check = parse_file(check_path)
    if check.errors or len(check.requests) != 1:
        raise ValueError(f"opt-out request would be malformed: {check.errors}")
    target = child(folder, name)
    fs, path = object_store.filesystem(target, storage_options)
    with fs.open_output_stream(path) as stream:
        stream.write(body)
    return target


def pending_requests(storage: Storage | str | Path, sample_id: str, limit: int = 20
                     ) -> list[str]:
    """Browser request files naming this sample (so the page can say it was requested)."""
    storage = as_storage(storage)
    options = storage.storage_options
    found = []
    for location in request_files(opt_out_dir(storage), options):
        name = name_of(location)
        if not (name.startswith("browser-") and name.endswith(".jsonl")):
            continue
        parsed = parse_file(location, options)
        if any(r.key_type == "id" and r.value == sample_id for r in parsed.requests):
            found.append(name)
            if len(found) >= limit:
                break
    return found
