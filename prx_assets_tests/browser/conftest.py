"""Browser-test fixtures: the tiny corpus built once, the corpus browser served from a
thread on a free port, and Debian's Chromium driven headless through Playwright."""

from __future__ import annotations

import pytest

from prx_assets.testing import tiny_corpus
from prx_assets.testing.chromium import CHROMIUM_ARGS, chromium_path
from prx_assets.testing.served_app import CURATOR_TOKEN, ServedApp


@pytest.fixture(scope="session")
def tiny(tmp_path_factory, ray_session) -> tiny_corpus.TinyCorpus:
    return tiny_corpus.build(tmp_path_factory.mktemp("tiny_corpus"))




@pytest.fixture(scope="session")
def served(tiny) -> ServedApp:
    """The browser with one curator (`CURATOR_TOKEN`), so the opt-out flow can be driven;
    its tables re-checked on every request, so a page reloaded after a job shows what the
    job wrote (no race against the catalog's two-second reuse)."""
    from prx_assets.browser.app import create_app
    from prx_assets.browser.auth import BrowserAuth, Curators

    auth = BrowserAuth(Curators.parse(f"curator {CURATOR_TOKEN}"))
    with ServedApp(tiny.data_root, create_app(tiny.data_root, auth, table_ttl_s=0)) as app:
        yield app


# Per module, not per session: while a sync Playwright is live its event loop counts as
# running, and a later test of the same process calling asyncio.run (Dagster's automation
# evaluation does) fails.
@pytest.fixture(scope="module")
def chromium():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        try:
            executable = chromium_path()
        except FileNotFoundError as err:
            pytest.fail(str(err), pytrace=False)
        browser = playwright.chromium.launch(executable_path=executable, headless=True,
                                             args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture()
def page(chromium):
    context = chromium.new_context(viewport={"width": 1400, "height": 1000})
    context.set_default_timeout(30_000)  # a safety net: every wait is on an element or event
    page = context.new_page()
    yield page
    context.close()
