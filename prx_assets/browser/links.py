"""URLs of corpus-browser views, for Dagster asset metadata (when a browser is configured),
and of Dagster asset pages, for the browser's sample pages.

`PRX_BROWSER_URL` (e.g. `http://127.0.0.1:8080`) is where `prx-assets browse` serves; when it
is unset no link is added.
"""

from __future__ import annotations

import os
from datetime import datetime
from typing import Any
from urllib.parse import urlencode

from prx_assets.registry import PER_SOURCE, assets_of
from prx_assets.storage.tables import CORPUS, DUPLICATES, OPT_OUTS, SKIP_LISTS

BROWSER_URL_ENV = "PRX_BROWSER_URL"
# Where the browser's pages link into Dagster; `make ui` serves there by default.
DAGSTER_URL_ENV = "PRX_DAGSTER_URL"
DEFAULT_DAGSTER_URL = "http://127.0.0.1:3000"
# Which view matches which asset: the global ones with a page of their own, and every
# per-source step of the registry opens the grid narrowed to the source (with these
# facets besides).
GLOBAL_VIEWS = {CORPUS: "/", DUPLICATES: "/duplicates", OPT_OUTS: "/?skip=optout"}
SOURCE_VIEW_FACETS = {SKIP_LISTS: {"skip": "any"}}
SOURCE_VIEWS = {asset: SOURCE_VIEW_FACETS.get(asset, {}) for asset in assets_of(PER_SOURCE)}


def browser_base() -> str | None:
    base = os.environ.get(BROWSER_URL_ENV, "").strip().rstrip("/")
    return base or None


def view_url(asset: str, partition: str | None = None) -> str | None:
    """The browser view of an asset (of one source partition), or None."""
    base = browser_base()
    if base is None:
        return None
    if asset in GLOBAL_VIEWS:
        return base + GLOBAL_VIEWS[asset]
    if asset in SOURCE_VIEWS:
        params = {"source": partition, **SOURCE_VIEWS[asset]} if partition else {}
        return base + "/" + (f"?{urlencode(params)}" if params else "")
    return None


def dagster_base() -> str:
    return (os.environ.get(DAGSTER_URL_ENV, "").strip() or DEFAULT_DAGSTER_URL).rstrip("/")


def dagster_url(asset: str, partition: str | None = None) -> str:
    """The Dagster UI's page of an asset (partition): its latest materialisation and the
    run that made it."""
    query = f"?{urlencode({'partition': partition})}" if partition else ""
    return f"{dagster_base()}/assets/{asset}{query}"


def run_url(asset: str, partition: str, written_at: datetime | None, instance: Any) -> str:
    """The Dagster UI's page of the run that wrote a row: the first materialisation of the
    asset partition at or after the row's `created_at` (a run commits its rows, then
    reports its materialisation). The asset page without an instance (`instance` None) or
    when it holds no such run, say for a corpus built elsewhere."""
    run_id = _writing_run(asset, partition, written_at, instance)
    return f"{dagster_base()}/runs/{run_id}" if run_id else dagster_url(asset, partition)


def _writing_run(asset: str, partition: str, written_at: datetime | None, instance: Any
                 ) -> str | None:
    if instance is None or written_at is None:
        return None
    import dagster as dg

    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey(asset), asset_partitions=[partition],
                              after_timestamp=written_at.timestamp()),
        limit=1, ascending=True).records
    return records[0].run_id if records else None


def dagster_home_instance() -> Any:
    """The Dagster instance under DAGSTER_HOME (the one `make ui` shows), or None."""
    if not os.environ.get("DAGSTER_HOME"):
        return None
    import dagster as dg

    try:
        return dg.DagsterInstance.get()
    except Exception:  # an unreadable instance only costs the exact link, not the page
        return None
