"""The corpus browser served from a thread of this process on a free port, for tests that
talk to it over HTTP or drive it from Chromium."""

from __future__ import annotations

import http.client
import re
import threading
from pathlib import Path
from urllib.parse import urlencode, urlsplit

from prx_assets.testing.chromium import free_port


class ServedApp:
    def __init__(self, data_root: Path, app=None):
        import uvicorn

        from prx_assets.browser.app import create_app

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        app = app if app is not None else create_app(data_root)
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ServedApp:
        self.thread.start()
        # uvicorn sets `started` once the socket listens; bounded by a generous safety net.
        for _ in range(600):
            if self.server.started:
                return self
            if not self.thread.is_alive():
                raise RuntimeError("the browser app's server thread died on start")
            self.thread.join(0.05)
        raise RuntimeError("the browser app did not start listening within 30 s")

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


CURATOR_TOKEN = "curator-token-for-browser-tests"


class HttpClient:
    """A bare HTTP client of a served app, as a browser's requests reach it: no redirects
    followed, the session cookie kept by hand, the Origin header as given (the browser's
    writes check it). Its writes are opt-outs of one sample, under one reference."""

    def __init__(self, url: str, sample_id: str, origin: str | None = None,
                 reference: str = ""):
        self.netloc = urlsplit(url).netloc
        self.origin = origin if origin is not None else url
        self.sample_id = sample_id
        self.reference = reference
        self.cookie = ""

    def request(self, method: str, path: str, form: dict | None = None,
                origin: str | None = "default") -> tuple[int, dict, str]:
        connection = http.client.HTTPConnection(self.netloc, timeout=30)
        headers = {"Cookie": self.cookie} if self.cookie else {}
        body = None
        if form is not None:
            body = urlencode(form)
            headers["Content-Type"] = "application/x-www-form-urlencoded"
        sent_origin = self.origin if origin == "default" else origin
        if sent_origin:
            headers["Origin"] = sent_origin
        connection.request(method, path, body=body, headers=headers)
        response = connection.getresponse()
        text = response.read().decode()
        found = {k.lower(): v for k, v in response.getheaders()}
        connection.close()
        if "set-cookie" in found:
            self.cookie = found["set-cookie"].split(";", 1)[0]
        return response.status, found, text

    def login(self, token: str, origin: str | None = "default") -> int:
        return self.request("POST", "/login", {"token": token, "next": "/"}, origin)[0]

    def form_token(self) -> str:
        """The session's form token, from the sample's opt-out confirmation page."""
        _, _, page = self.request("GET", f"/sample/{self.sample_id}/opt-out")
        found = re.search(r'name="token" value="([^"]+)"', page)
        if found is None:
            raise LookupError(f"no form token on the opt-out page of {self.sample_id}")
        return found.group(1)

    def opt_out(self, token: str, origin: str | None = "default") -> int:
        """The confirmation form posted with its box ticked: the status answered."""
        return self.request("POST", f"/sample/{self.sample_id}/opt-out",
                            {"token": token, "confirm": "yes", "reference": self.reference},
                            origin)[0]
