"""Who may write through the browser, over HTTP: only a logged-in curator, from a page of
this server, with the session's form token, within the rate limit; anything else changes
nothing. `browse` refuses a non-loopback bind without curator tokens."""

from __future__ import annotations

import json
import logging

import pyarrow as pa
import pytest

from prx_assets.browser.app import UnsafeBind, check_bind, create_app
from prx_assets.browser.auth import BrowserAuth, Curators, RateLimit, Sessions
from prx_assets.storage.lance_tables import overwrite_rows
from prx_assets.storage.layout import Storage
from prx_assets.testing.served_app import HttpClient, ServedApp

TOKEN = "alice-token-0123456789abcdef"
SAMPLE = "web:0123456789abcdef"
WRITES_PER_MINUTE = 3


class Client(HttpClient):
    """The shared client on this file's sample, reference and curator token."""

    def __init__(self, url: str, origin: str | None = None):
        super().__init__(url, SAMPLE, origin, reference="ticket-9")

    def login(self, token: str = TOKEN, origin: str | None = "default") -> int:
        return super().login(token, origin)


@pytest.fixture()
def root(tmp_path):
    data = tmp_path / "data"
    rows = pa.table({"id": [SAMPLE], "source": ["web"], "caption": ["a red bicycle"]})
    overwrite_rows(Storage(data).table("corpus"), rows, rows.schema)
    return data


def _auth() -> BrowserAuth:
    return BrowserAuth(Curators.parse(f"alice {TOKEN}\n# a comment\nbob bob-token-0123456789"),
                       writes=RateLimit(WRITES_PER_MINUTE, 60.0))


def _requests(root) -> list[dict]:
    return [json.loads(line) for path in sorted((root / "opt_outs").glob("*.jsonl"))
            for line in path.read_text().splitlines()]


def test_only_a_curator_from_this_origin_within_the_limit_writes(root, caplog):
    caplog.set_level(logging.INFO)
    with ServedApp(root, create_app(root, _auth())) as served:
        anonymous = Client(served.url)
        assert anonymous.opt_out("anything") == 401
        assert 'id="login-needed"' in anonymous.request("GET", f"/sample/{SAMPLE}/opt-out")[2]

        foreign = Client(served.url, origin="http://evil.example")
        assert foreign.login() == 403 and not foreign.cookie
        assert Client(served.url).login("wrong-token-0123456789") == 401

        curator = Client(served.url)
        status, headers, _ = curator.request("POST", "/login", {"token": TOKEN, "next": "/"})
        assert status == 303
        cookie = headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie
        token = curator.form_token()
        assert curator.opt_out(token, origin="http://evil.example") == 403
        assert curator.opt_out(token, origin=None) == 403  # neither Origin nor Referer
        assert curator.opt_out("forged") == 403
        assert not _requests(root)

        assert [curator.opt_out(token) for _ in range(WRITES_PER_MINUTE + 2)] == \
            [303] * WRITES_PER_MINUTE + [429, 429]
        written = _requests(root)
        assert len(written) == WRITES_PER_MINUTE
        assert {(r["value"], r["requested_by"], r["door"], r["reference"])
                for r in written} == {(SAMPLE, "alice", "browser", "ticket-9")}
        # Another curator has a limit of their own.
        other = Client(served.url)
        assert other.login("bob-token-0123456789") == 303
        assert other.opt_out(other.form_token()) == 303
        # Logged out, the old cookie writes nothing.
        old_cookie = curator.cookie
        curator.request("POST", "/logout", {})
        curator.cookie = old_cookie
        assert curator.opt_out(token) == 401
    assert TOKEN not in caplog.text and "bob-token" not in caplog.text
    assert "curator alice logged in" in caplog.text


def test_without_curator_tokens_the_browser_only_reads(root):
    with ServedApp(root, create_app(root)) as served:
        client = Client(served.url)
        assert client.request("GET", f"/sample/{SAMPLE}/opt-out")[0] == 200
        assert client.login() == 403
        assert client.opt_out("anything") == 403
    assert not (root / "opt_outs").exists()


def test_a_non_loopback_bind_needs_curators_and_then_a_session_to_read(root, monkeypatch,
                                                                       capsys):
    from prx_assets.cli import main

    assert check_bind("127.0.0.1", None) is False and check_bind("::1", None) is False
    with pytest.raises(UnsafeBind, match="PRX_CURATOR_TOKENS"):
        check_bind("0.0.0.0", None)
    monkeypatch.delenv("PRX_CURATOR_TOKENS", raising=False)
    assert main(["browse", "--host", "0.0.0.0"]) == 2
    assert "needs curator tokens" in capsys.readouterr().err
    curators = Curators.parse(f"alice {TOKEN}")
    assert check_bind("0.0.0.0", curators) is True
    with ServedApp(root, create_app(root, BrowserAuth(curators), private_reads=True)) as served:
        client = Client(served.url)
        status, headers, _ = client.request("GET", "/")
        assert status == 303 and headers["location"].startswith("/login")
        assert client.request("GET", "/login")[0] == 200
        assert client.login() == 303
        assert client.request("GET", f"/sample/{SAMPLE}/opt-out")[0] == 200


def test_tokens_come_from_a_file_or_a_variable_and_are_not_kept(tmp_path, monkeypatch):
    path = tmp_path / "curators"
    path.write_text(f"alice {TOKEN}\n")
    curators = Curators.load(str(path))
    assert curators.who(TOKEN) == "alice" and curators.who(TOKEN + "x") is None
    assert TOKEN not in repr(curators) and TOKEN.encode() not in b"".join(curators.by_digest)
    monkeypatch.setenv("CURATOR_SECRET", f"carol {TOKEN}")
    assert Curators.load("env:CURATOR_SECRET").who(TOKEN) == "carol"
    with pytest.raises(ValueError, match="16"):
        Curators.parse("dave short")


def test_sessions_expire():
    now = [1000.0]
    sessions = Sessions(hours=1, clock=lambda: now[0])
    session_id = sessions.start("alice")
    assert sessions.get(session_id).curator == "alice"
    now[0] += 3601
    assert sessions.get(session_id) is None


def test_two_server_processes_share_sessions_and_rate_limits(tmp_path, monkeypatch):
    """Before: sessions and limits lived in one process's memory (lost on a restart, not
    seen by a second server process). Two stores over one file stand for two processes:
    each opens its own SQLite connection per call."""
    from prx_assets.browser.app import browser_auth

    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path))
    curators = Curators.parse(f"alice {TOKEN}")
    one, two = browser_auth(curators), browser_auth(curators)
    assert (tmp_path / "browser_auth.sqlite").exists()
    session_id = one.sessions.start("alice")
    assert two.sessions.get(session_id) == one.sessions.get(session_id)
    assert two.sessions.get(session_id).curator == "alice"
    allowed = [server.writes.allow("alice") for server in (one, two) * 6]
    assert allowed.count(True) == one.writes.limit == 10  # one window across both
    assert two.logins.allow("alice")  # a limit of its own
    two.sessions.end(session_id)
    assert one.sessions.get(session_id) is None
    restarted = browser_auth(curators)
    assert not restarted.writes.allow("alice")  # a restart forgets nothing
