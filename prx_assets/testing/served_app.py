"""The corpus browser served from a thread of this process on a free port, for tests that
talk to it over HTTP or drive it from Chromium."""

from __future__ import annotations

import threading
from pathlib import Path

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
