"""The soak's opt-out doors besides the CLI (a request file dropped in the opt-out folder,
the browser's curator form over HTTP) and its S3 data root."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from bench.soak_sources import ModelSource

if TYPE_CHECKING:
    from bench.soak import Soak

CURATOR_TOKEN = "soak-curator-token-0123456789"  # the browser door's curator
S3_BUCKET = "prx-soak"


def drop_request(state: Soak, source: ModelSource, sample_id: str) -> str:
    """A request file dropped in the folder (the file door), naming the sample by its
    key in its source."""
    keys = {sid: key for unit in source.units.values() for key in unit
            for sid in [_sample_id(source.name, key)]}
    if sample_id not in keys:  # published, but gone from the source since: by id
        record = {"key_type": "id", "value": sample_id}
    else:
        record = {"key_type": "source_key", "value": keys[sample_id],
                  "source": source.name}
    name = f"dropped-{state.number:05d}-{state.rng.randrange(10**6):06d}.jsonl"
    (state.storage.opt_outs_dir / name).write_text(json.dumps({
        **record, "timestamp": "2026-01-01T00:00:00Z",
        "reference": f"soak {state.seed}"}) + "\n")
    return f"file {name}"


def browser_request(state: Soak, sample_id: str) -> str:
    """The curator's door over HTTP, as a browser reaches it: the corpus browser served
    on a free port, a curator logged in, the confirmation page's form token, the form
    posted (the browser tests drive the same page in Chromium). The page finds the
    sample in the `corpus` table, so its job runs first, as a person would have."""
    from prx_assets.browser.app import create_app
    from prx_assets.browser.auth import BrowserAuth, Curators
    from prx_assets.testing.served_app import HttpClient, ServedApp

    if not state.run_here("corpus_table_job", None):
        raise state.violation("corpus_table_job failed on a plain run")
    auth = BrowserAuth.shared(Curators.parse(f"soak {CURATOR_TOKEN}"),
                              state.home / "browser.sqlite")
    app = create_app(state.storage, auth, table_ttl_s=0)
    with ServedApp(state.data_root, app) as served:
        client = HttpClient(served.url, sample_id, reference=f"soak {state.seed}")
        logged_in = client.login(CURATOR_TOKEN)
        status = client.opt_out(client.form_token()) if logged_in == 303 else logged_in
    if status != 303:  # the form's answer: back to the sample page
        raise state.violation(f"the browser refused an opt-out of {sample_id}: {status}")
    return "browser"


def _sample_id(source: str, key: str) -> str:
    from prx_assets.stages.ingest.ids import sample_id

    return sample_id(source, key)


@contextlib.contextmanager
def s3_data_root(work: Path, seed: int):
    """An `s3://` data root of its own in a bucket of the S3 test server, the standard AWS
    variables pointing at it: the server `AWS_ENDPOINT_URL` names when that is on this
    machine (its credentials those of the environment), else one started under `work` and
    stopped on the way out."""
    import uuid
    from urllib.parse import urlparse

    from prx_assets.testing.s3_server import S3Server, start_seaweedfs

    endpoint = os.environ.get("AWS_ENDPOINT_URL", "")
    server: S3Server | None = None
    if urlparse(endpoint).hostname in ("127.0.0.1", "localhost"):
        import boto3

        client = boto3.client("s3", endpoint_url=endpoint)
        with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
            client.create_bucket(Bucket=S3_BUCKET)
    else:
        server = start_seaweedfs(work / "s3-server")
        server.create_bucket(S3_BUCKET)
        os.environ.update(server.env())
    try:
        yield f"s3://{S3_BUCKET}/soak-{seed}-{uuid.uuid4().hex[:8]}"
    finally:
        if server is not None:
            server.stop()
