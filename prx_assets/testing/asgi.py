"""One request to an ASGI app in this process, without a server or an HTTP client: for
tests that send many requests (the browser's fuzz) and want each answer in milliseconds."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from urllib.parse import quote, urlencode


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")


def get(app, segments: list[str], params: dict[str, str] | None = None) -> Answer:
    """GET of the path made of `segments` (each percent-encoded whole, so any text stays one
    segment) with `params` as its query string."""
    raw_path = "/" + "/".join(quote(s, safe="") for s in segments)
    return asyncio.run(_call(app, raw_path, urlencode(params or {})))


async def _call(app, raw_path: str, query: str) -> Answer:
    from urllib.parse import unquote

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "GET", "scheme": "http", "path": unquote(raw_path),
             "raw_path": raw_path.encode(), "root_path": "", "query_string": query.encode(),
             "headers": [(b"host", b"testserver")], "client": ("127.0.0.1", 1234),
             "server": ("testserver", 80)}
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return Answer(start["status"], body)
