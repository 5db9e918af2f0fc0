"""What every view of the browser reads: the tables, who may write, the templates."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import jinja2
from starlette.requests import Request
from starlette.responses import HTMLResponse

from prx_assets.browser.auth import BrowserAuth
from prx_assets.browser.catalog import TABLE_TTL_S, Catalog
from prx_assets.storage.layout import Storage

HERE = Path(__file__).parent


@dataclass(frozen=True)
class BrowserState:
    """What every handler reads: the tables, who may write, the templates."""

    catalog: Catalog
    auth: BrowserAuth
    templates: jinja2.Environment
    private_reads: bool = False  # reading too needs a session (a non-loopback bind)
    dagster: Any = None  # the Dagster instance for exact run links (`serve` opens it)

    @classmethod
    def create(cls, storage: Storage | str | Path, auth: BrowserAuth | None = None,
               private_reads: bool = False, dagster: Any = None,
               table_ttl_s: float = TABLE_TTL_S) -> BrowserState:
        templates = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"),
                                       autoescape=True, undefined=jinja2.StrictUndefined)
        templates.globals["urlencode"] = urlencode
        return cls(Catalog(storage, table_ttl_s), auth or BrowserAuth(), templates,
                   private_reads, dagster)

    def render(self, request: Request, template: str, status: int = 200, **context: Any
               ) -> HTMLResponse:
        html = self.templates.get_template(template).render(request=request, **context)
        return HTMLResponse(html, status_code=status)

    def error(self, request: Request, status: int, title: str, message: str) -> HTMLResponse:
        return self.render(request, "error.html", status=status, title=title, message=message)

    def not_found(self, request: Request, message: str) -> HTMLResponse:
        return self.error(request, 404, "Not found", message)
