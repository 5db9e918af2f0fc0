"""Who may write through the corpus browser: authenticated curators, same origin, bounded.

Reading needs nothing on a loopback bind. Every write (an opt-out, anything added later)
needs, in this order:

1. a session: a curator logs in with a token from the token file (`PRX_CURATOR_TOKENS`
   names it: a file path, or `env:VAR` for a variable a secret store fills); the server
   answers with a random session id in a cookie that is `HttpOnly` and `SameSite=Strict`,
   valid for `SESSION_HOURS`;
2. the same origin: the request's `Origin` (or, lacking one, its `Referer`) is this server;
3. the session's form token in the form (a page this server rendered for that session);
4. the curator's rate limit (`RateLimit`: at most N writes per window).

A request failing any of them changes nothing. Tokens are compared as SHA-256 digests in
constant time and never stored, logged or shown; the token file is never in the repository
(it is named by configuration). Failed logins share a per-client limit, so a token cannot
be guessed by trying.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from starlette.requests import Request

TOKENS_ENV = "PRX_CURATOR_TOKENS"
SESSION_COOKIE = "prx_session"
SESSION_HOURS = 8.0
CURATOR_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789_-.@")


class AuthConfigError(ValueError):
    """The token file is missing or malformed (the message never holds a token)."""


@dataclass(frozen=True)
class Curators:
    """Curator names by the SHA-256 digest of their token (the tokens themselves are not
    kept)."""

    by_digest: dict[bytes, str] = field(repr=False)

    @classmethod
    def load(cls, where: str) -> Curators:
        """From `where`: a file path, or `env:VAR`. One `<curator> <token>` per line, `#`
        comments; names are lower-case [a-z0-9_-.@], tokens at least 16 characters."""
        if where.startswith("env:"):
            text = os.environ.get(where[4:])
            if text is None:
                raise AuthConfigError(f"curator tokens: variable {where[4:]} is not set")
        else:
            try:
                text = Path(where).read_text()
            except OSError as exc:
                raise AuthConfigError(f"curator tokens: cannot read {where}: "
                                      f"{exc.strerror}") from None
        return cls.parse(text, where)

    @classmethod
    def parse(cls, text: str, where: str = "tokens") -> Curators:
        found: dict[bytes, str] = {}
        for number, raw in enumerate(text.splitlines(), start=1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2 or not set(parts[0]) <= CURATOR_NAME_CHARS or len(parts[1]) < 16:
                raise AuthConfigError(f"{where}:{number}: expected '<curator> <token>' with a "
                                      "lower-case name and a token of 16+ characters")
            found[_digest(parts[1])] = parts[0]
        if not found:
            raise AuthConfigError(f"{where}: no curator token")
        return cls(found)

    @classmethod
    def from_env(cls) -> Curators | None:
        where = os.environ.get(TOKENS_ENV)
        return cls.load(where) if where else None

    def who(self, token: str) -> str | None:
        """The curator holding `token`, None for any other string."""
        offered = _digest(token)
        curator = None
        for digest, name in self.by_digest.items():  # every digest compared: no early exit
            if hmac.compare_digest(digest, offered):
                curator = name
        return curator


def _digest(token: str) -> bytes:
    return hashlib.sha256(str(token).encode()).digest()


AUTH_DB = "browser_auth.sqlite"  # beside the Dagster instance ($DAGSTER_HOME)
_AUTH_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (id TEXT PRIMARY KEY, curator TEXT NOT NULL,
                                     form_token TEXT NOT NULL, expires REAL NOT NULL);
CREATE TABLE IF NOT EXISTS events (name TEXT NOT NULL, key TEXT NOT NULL, at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS events_by_key ON events (name, key, at);
"""


class AuthStore:
    """Where sessions and rate-limit events live: a SQLite file that every server process
    started with it shares (and that outlives a restart), or, without a path, this
    process's memory. Each check-and-count is one IMMEDIATE transaction, so two processes
    never both take a window's last slot."""

    def __init__(self, path: Path | str | None = None) -> None:
        self.path = None if path is None else Path(path)
        self._lock = threading.Lock()
        self._memory = (sqlite3.connect(":memory:", check_same_thread=False,
                                        isolation_level=None) if self.path is None else None)
        with self.transaction() as db:
            for statement in _AUTH_SCHEMA.split(";")[:-1]:  # executescript would commit
                db.execute(statement)

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            db = self._memory or sqlite3.connect(self.path or "", timeout=10.0,
                                                 isolation_level=None)
            try:
                db.execute("BEGIN IMMEDIATE")
                try:
                    yield db
                except BaseException:
                    db.execute("ROLLBACK")
                    raise
                db.execute("COMMIT")
            finally:
                if db is not self._memory:
                    db.close()


class RateLimit:
    """At most `limit` events per key in any `window_s` seconds (a sliding window), counted
    in `store` under `name` (processes sharing the store share the limit)."""

    def __init__(self, limit: int, window_s: float,
                 clock: Callable[[], float] = time.time, store: AuthStore | None = None,
                 name: str = "events") -> None:
        self.limit, self.window_s, self.clock = limit, window_s, clock
        self.store, self.name = store or AuthStore(), name

    def allow(self, key: str) -> bool:
        """Count one event for `key` if the window has room; False (not counted) if not."""
        now = self.clock()
        with self.store.transaction() as db:
            db.execute("DELETE FROM events WHERE name = ? AND key = ? AND at <= ?",
                       (self.name, key, now - self.window_s))
            (count,) = db.execute("SELECT COUNT(*) FROM events WHERE name = ? AND key = ?",
                                  (self.name, key)).fetchone()
            if count >= self.limit:
                return False
            db.execute("INSERT INTO events VALUES (?, ?, ?)", (self.name, key, now))
            return True


@dataclass(frozen=True)
class Session:
    curator: str
    form_token: str  # put in each form this session is shown; a write must carry it back
    expires: float


class Sessions:
    """Server-side sessions by random id (nothing about the curator is in the cookie), kept
    in `store` (processes sharing the store share the sessions)."""

    def __init__(self, hours: float = SESSION_HOURS,
                 clock: Callable[[], float] = time.time, store: AuthStore | None = None) -> None:
        self.seconds, self.clock = hours * 3600, clock
        self.store = store or AuthStore()

    def start(self, curator: str) -> str:
        session_id = secrets.token_urlsafe(32)
        with self.store.transaction() as db:
            db.execute("INSERT INTO sessions VALUES (?, ?, ?, ?)",
                       (session_id, curator, secrets.token_urlsafe(32),
                        self.clock() + self.seconds))
        return session_id

    def get(self, session_id: str | None) -> Session | None:
        if not session_id:
            return None
        with self.store.transaction() as db:
            db.execute("DELETE FROM sessions WHERE expires <= ?", (self.clock(),))
            row = db.execute("SELECT curator, form_token, expires FROM sessions WHERE id = ?",
                             (session_id,)).fetchone()
        return None if row is None else Session(*row)

    def end(self, session_id: str | None) -> None:
        with self.store.transaction() as db:
            db.execute("DELETE FROM sessions WHERE id = ?", (session_id or "",))


@dataclass
class BrowserAuth:
    """The browser's write policy: curators (None: nobody may write), their sessions, the
    per-curator write limit and the per-client login limit."""

    curators: Curators | None = None
    sessions: Sessions = field(default_factory=Sessions)
    writes: RateLimit = field(default_factory=lambda: RateLimit(10, 60.0, name="writes"))
    logins: RateLimit = field(default_factory=lambda: RateLimit(5, 300.0, name="logins"))
    secure_cookie: bool = False  # True behind HTTPS: the cookie is then never sent in clear

    @classmethod
    def shared(cls, curators: Curators | None, path: Path | str) -> BrowserAuth:
        """Sessions and both rate limits in the SQLite file at `path`: every server process
        started with it sees the same sessions and counts against the same limits."""
        store = AuthStore(path)
        return cls(curators, Sessions(store=store),
                   RateLimit(10, 60.0, store=store, name="writes"),
                   RateLimit(5, 300.0, store=store, name="logins"))

    @property
    def configured(self) -> bool:
        return self.curators is not None

    def session(self, request: Request) -> Session | None:
        return self.sessions.get(request.cookies.get(SESSION_COOKIE))

    def cookie(self, session_id: str) -> dict:
        """Keyword arguments of `Response.set_cookie` for a new session."""
        return {"key": SESSION_COOKIE, "value": session_id, "httponly": True,
                "samesite": "strict", "secure": self.secure_cookie, "path": "/",
                "max_age": int(self.sessions.seconds)}


def same_origin(request: Request) -> bool:
    """Whether the request comes from a page of this server: its `Origin` header (or the
    origin of its `Referer` when a client sends no Origin) equals this server's origin.
    A request with neither is refused: every browser sends Origin on a form POST."""
    claimed = request.headers.get("origin")
    if not claimed or claimed == "null":
        referer = urlsplit(request.headers.get("referer", ""))
        claimed = f"{referer.scheme}://{referer.netloc}" if referer.netloc else ""
    host = request.headers.get("host", "")
    return bool(claimed and host) and claimed == f"{request.url.scheme}://{host}"


def is_loopback(host: str) -> bool:
    """Whether binding `host` serves only this machine."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
