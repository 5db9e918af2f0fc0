"""Debian's Chromium, as the browser tests and the browser bench launch it."""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

# No sandbox (tests run as root in containers), no GPU, and nothing that phones home.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-default-apps"]


def chromium_path() -> str:
    """Debian's chromium (`make install` installs it); PRX_CHROMIUM names another binary."""
    path = os.environ.get("PRX_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(path).exists():
        raise FileNotFoundError(f"no Chromium at {path}: run `make install` (apt-get install "
                                "chromium) or set PRX_CHROMIUM")
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


SCREENSHOTS_ENV = "PRX_BROWSER_SCREENSHOTS"


def screenshot(page, name: str, full_page: bool = False) -> None:
    """`$PRX_BROWSER_SCREENSHOTS/<name>.png` when that folder is set (how docs/browser/ is
    regenerated: run the browser tests with it set); nothing otherwise."""
    folder = os.environ.get(SCREENSHOTS_ENV)
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(folder) / f"{name}.png"), full_page=full_page)
