"""Secrets stay secret: no test credential in anything a small in-process run writes (the
tables, the Dagster instance's run, event and config storage, the logs), an endpoint that
holds a credential is refused as configuration, and error text is redacted."""

from __future__ import annotations

import logging

import dagster as dg
import pytest

from prx_assets.definitions import build_defs
from prx_assets.defs.resources import captioner_from_file
from prx_assets.engine.redact import redact, url_credentials
from prx_assets.models.openai_client import EndpointError, OpenAIClient
from prx_assets.testing.images import jpeg_bytes
from prx_assets.testing.sources import write_sources

API_KEY = "sk-test-APIKEY-5f1d2c3b4a"
AWS_SECRET = "aws-test-SECRET-9e8d7c6b5a"
AWS_KEY_ID = "AKIATESTKEYID0001"


def _artefacts(*folders) -> dict[str, bytes]:
    return {str(path): path.read_bytes() for folder in folders
            for path in folder.rglob("*") if path.is_file()}


def test_no_credential_in_what_a_run_writes(ray_session, data_root, tmp_path, monkeypatch,
                                            caplog, capfd):
    caplog.set_level(logging.DEBUG)
    for name, value in (("OPENAI_API_KEY", API_KEY), ("AWS_SECRET_ACCESS_KEY", AWS_SECRET),
                        ("AWS_ACCESS_KEY_ID", AWS_KEY_ID)):
        monkeypatch.setenv(name, value)
    folder = tmp_path / "imgs"
    folder.mkdir()
    for i in range(2):
        (folder / f"p{i}.jpg").write_bytes(jpeg_bytes(700, 560, i))
    sources = write_sources(tmp_path / "s.yaml", [f"{{name: web, kind: image_folder, "
                                                  f"uri: {folder}}}"])
    captioner = tmp_path / "captioner.yaml"
    # Nothing listens on port 9: every request fails, and its error lands in the table.
    captioner.write_text("backend: openai\nmodel: m\nendpoint: http://127.0.0.1:9/v1\n"
                         "max_retries: 0\ntimeout_s: 2\n")
    defs = build_defs(sources, captioner)
    home = tmp_path / "dagster_home"
    home.mkdir()
    with dg.instance_for_test(temp_dir=str(home)) as instance:
        selection = [dg.AssetKey(k) for k in ("raw_images", "bucketed_images", "phashes",
                                              "captions")]
        result = defs.resolve_job_def("source_job").execute_in_process(
            partition_key="web", instance=instance, asset_selection=selection,
            raise_on_error=False)
        events = "\n".join(str(e) for e in instance.all_logs(result.run_id))
    captions = (data_root / "lance" / "captions" / "web.lance")
    assert captions.exists()
    from prx_assets.storage.layout import Storage
    errors = Storage(data_root).table("captions", "web").to_table(columns=["error"])
    assert any(errors.column("error").to_pylist())  # the failures were recorded
    written = _artefacts(data_root, home)
    out, err = capfd.readouterr()
    texts = {"event log": events, "log records": caplog.text, "stdout": out, "stderr": err}
    for secret in (API_KEY, AWS_SECRET, AWS_KEY_ID):
        assert not [path for path, data in written.items() if secret.encode() in data], secret
        assert not [name for name, text in texts.items() if secret in text], secret


def test_an_endpoint_holding_a_credential_is_refused_as_config(tmp_path):
    """Before: the key in the endpoint's query (or a password in it) was resource config,
    shown in the UI, and quoted whole in every failed row's `error`."""
    for endpoint in ("http://user:pw-123456@127.0.0.1:9/v1",
                     "http://127.0.0.1:9/v1?api-key=abcdef123456"):
        path = tmp_path / "captioner.yaml"
        path.write_text(f"backend: openai\nmodel: m\nendpoint: {endpoint}\n")
        with pytest.raises(ValueError, match="api_key_env"):
            captioner_from_file(path)
    assert url_credentials("http://127.0.0.1:8000/v1") is None


def test_error_text_is_redacted(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    text = (f"POST https://bob:hunter2pw@h/v1?x=1&api_key=K123456789&sig=abc failed; "
            f"Authorization: Bearer {API_KEY}; key {API_KEY}")
    clean = redact(text)
    for secret in ("hunter2pw", "K123456789", "sig=abc", API_KEY):
        assert secret not in clean
    assert "x=1" in clean and "https://***@h/v1" in clean
    client = OpenAIClient(f"http://127.0.0.1:9/{API_KEY}/v1", max_retries=0, timeout_s=2)
    with pytest.raises(EndpointError) as caught:
        client.complete({"model": "m", "messages": []})
    assert API_KEY not in str(caught.value) and "127.0.0.1:9" in str(caught.value)
