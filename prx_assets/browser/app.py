"""The corpus browser: a server-rendered Starlette app over the pipeline's Lance tables.

Views (each a few bounded Lance queries, see `queries`):

    /                         grid of thumbnails; ?q= full text, ?similar=ID more like this,
                              facets source/label/tier/shape/dup/skip, ?page=
    /sample/{id}              one sample: full image, every caption version, labels, its
                              duplicate group, near duplicates, skip reasons, lineage
    /sample/{id}/opt-out      GET: the confirmation page; POST (page token): the request
    /duplicates               near-duplicate clusters (Hamming 1-4), exact groups and
                              semantic (SemDeDup) groups
    /rejected                 counts of rejected images per reason and source; ?reason=
                              (&source=, &page=) a page of them, thumbnails where they decode
    /reject-thumb/{id}        a thumbnail of a rejected image, from its raw bytes
    /original/{id}            a sample's original (raw bytes), downscaled to 1024 px
    /random                   redirect to a random sample
    /thumb/{id}, /image/{id}  JPEG bytes (thumbnail from `corpus`, full from
                              `bucketed_images`), with caching headers
    /favicon.ico              the icon (an SVG), so no page logs a 404

Each view is a handler function of the request and the app's `BrowserState` (its tables,
opt-out tokens and templates); `ROUTES` maps the URLs to them and `create_app` binds them
to one state. Path parameters are sample ids, validated and looked up in tables; nothing
from a request is joined into a file path. Templates autoescape everything.

Handlers are plain functions, which Starlette runs in its thread pool: Lance queries block
(and release the GIL), so the thumbnails of one page are read in parallel rather than one
after another on the event loop. The opt-out handler is async only to read its form.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlencode

import jinja2
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from prx_assets.browser import queries, rejects
from prx_assets.browser.cards import published, tree_card
from prx_assets.browser.catalog import BadQuery, Catalog, NotFound
from prx_assets.browser.facets import Query
from prx_assets.browser.links import dagster_url
from prx_assets.browser.optout import Tokens, pending_requests, write_request
from prx_assets.storage.layout import Storage
from prx_assets.storage.tables import BUCKETED_IMAGES

HERE = Path(__file__).parent
# Immutable per corpus version: the ETag names the version, so a rebuilt corpus is refetched.
THUMB_CACHE = "public, max-age=86400"
IMAGE_CACHE = "public, max-age=3600"
ORIGINAL_PX = 1024  # the original beside the bucketed crop, at most this on its longest side


@dataclass(frozen=True)
class BrowserState:
    """What every handler reads: the tables, the opt-out page tokens, the templates."""

    catalog: Catalog
    tokens: Tokens
    templates: jinja2.Environment

    @classmethod
    def create(cls, storage: Storage | str | Path, tokens: Tokens | None = None
               ) -> BrowserState:
        templates = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"),
                                       autoescape=True, undefined=jinja2.StrictUndefined)
        templates.globals["urlencode"] = urlencode
        return cls(Catalog(storage), tokens or Tokens(), templates)

    def render(self, request: Request, template: str, status: int = 200, **context: Any
               ) -> HTMLResponse:
        html = self.templates.get_template(template).render(request=request, **context)
        return HTMLResponse(html, status_code=status)

    def error(self, request: Request, status: int, title: str, message: str) -> HTMLResponse:
        return self.render(request, "error.html", status=status, title=title, message=message)

    def not_found(self, request: Request, message: str) -> HTMLResponse:
        return self.error(request, 404, "Not found", message)


# -------------------------------------------------------------------------------- pages

def grid_page(request: Request, state: BrowserState) -> Response:
    try:
        query = Query.parse(dict(request.query_params))
        result = queries.grid(state.catalog, query)
        info = queries.overview(state.catalog)
    except BadQuery as err:
        return state.error(request, 400, "Bad request", str(err))
    except NotFound as err:  # also a `similar` id that cannot be a sample's
        return state.not_found(request, str(err))
    return state.render(request, "grid.html", query=query, grid=result, info=info,
                        shapes=queries.shape_grid(result.facets.get("tier_shape", [])),
                        page_size=queries.PAGE_SIZE, max_hits=queries.MAX_SEARCH_HITS,
                        max_facet_rows=queries.MAX_FACET_ROWS)


def cards_page(request: Request, state: BrowserState) -> Response:
    """Every published tree's card: the list, and one card when the path names it."""
    storage = state.catalog.storage
    kind, name = request.path_params.get("kind"), request.path_params.get("name")
    found = tree_card(storage, kind, name) if kind and name else None
    if kind and found is None:
        return state.not_found(request, f"no published {kind} tree named {name!r}")
    return state.render(request, "cards.html", trees=published(storage), card=found)


def sample_page(request: Request, state: BrowserState) -> Response:
    try:
        found = queries.sample(state.catalog, request.path_params["sample_id"])
    except NotFound as err:
        return state.not_found(request, str(err))
    return state.render(request, "sample.html", s=found, token=state.tokens.token(found.id),
                        dagster=dagster_url(BUCKETED_IMAGES, found.row["source"]),
                        requested=pending_requests(state.catalog.storage, found.id),
                        opted=request.query_params.get("opted") == "1")


async def opt_out_page(request: Request, state: BrowserState) -> Response:
    """GET: the confirmation page. POST: with the page's token and the box ticked, one new
    request file, then back to the sample page."""
    try:
        row = await run_in_threadpool(queries.corpus_row, state.catalog,
                                      request.path_params["sample_id"],
                                      ["id", "source", "caption"])
    except NotFound as err:
        return state.not_found(request, str(err))
    if request.method == "GET":
        return state.render(request, "optout.html", row=row, token=state.tokens.token(row["id"]))
    form = await request.form()
    if not state.tokens.valid(row["id"], str(form.get("token", ""))):
        return state.error(request, 403, "Forbidden", "the opt-out form's token is missing "
                           "or wrong: open the sample page and try again")
    if form.get("confirm") != "yes":
        return state.error(request, 400, "Not confirmed",
                           "tick the confirmation box to opt this image out")
    await run_in_threadpool(write_request, state.catalog.storage, row["id"],
                            str(form.get("reference", "")))
    return RedirectResponse(f"/sample/{row['id']}?opted=1", status_code=303)


def duplicates_page(request: Request, state: BrowserState) -> Response:
    page_text = request.query_params.get("page", "0")
    if not page_text.isdigit() or int(page_text) > 100_000:
        return state.error(request, 400, "Bad request", "page must be a small number")
    try:
        near = queries.near_clusters(state.catalog)
    except NotFound as err:
        return state.not_found(request, str(err))
    groups, total = queries.exact_groups(state.catalog, int(page_text))
    semantic, semantic_total = queries.semantic_groups(state.catalog, int(page_text))
    return state.render(request, "duplicates.html", near=near[:100], near_total=len(near),
                        groups=groups, groups_total=total, page=int(page_text),
                        semantic=semantic, semantic_total=semantic_total)


def rejected_page(request: Request, state: BrowserState) -> Response:
    params = request.query_params
    page_text = params.get("page", "0")
    if not page_text.isdigit() or int(page_text) > 100_000:
        return state.error(request, 400, "Bad request", "page must be a small number")
    try:
        page = (rejects.rejects(state.catalog, params["reason"], params.get("source", ""),
                                int(page_text)) if params.get("reason") else None)
        counts = rejects.reject_counts(state.catalog)
    except BadQuery as err:
        return state.error(request, 400, "Bad request", str(err))
    except NotFound as err:
        return state.not_found(request, str(err))
    return state.render(request, "rejected.html", counts=counts, page=page)


def random_sample(request: Request, state: BrowserState) -> Response:
    try:
        sample_id = queries.random_id(state.catalog)
    except NotFound as err:
        return state.not_found(request, str(err))
    return RedirectResponse(f"/sample/{sample_id}", status_code=303)


# -------------------------------------------------------------------------------- images

def thumbnail_jpeg(request: Request, state: BrowserState) -> Response:
    try:
        data, version = queries.thumbnail(state.catalog, request.path_params["sample_id"])
    except NotFound:
        raise HTTPException(404) from None
    return _jpeg(request, data, version, THUMB_CACHE)


def image_jpeg(request: Request, state: BrowserState) -> Response:
    try:
        data, version = queries.full_image(state.catalog, request.path_params["sample_id"])
    except NotFound:
        raise HTTPException(404) from None
    return _jpeg(request, data, version, IMAGE_CACHE)


def reject_jpeg(request: Request, state: BrowserState) -> Response:
    try:
        data, version = rejects.reject_thumbnail(state.catalog,
                                                 request.path_params["sample_id"])
    except NotFound:
        raise HTTPException(404) from None
    return _jpeg(request, data, version, IMAGE_CACHE)


def original_jpeg(request: Request, state: BrowserState) -> Response:
    """The sample's original (its raw bytes, before the crop to its bucket), downscaled."""
    try:
        data, version = rejects.raw_preview(state.catalog, request.path_params["sample_id"],
                                            ORIGINAL_PX)
    except NotFound:
        raise HTTPException(404) from None
    return _jpeg(request, data, version, IMAGE_CACHE)


def _jpeg(request: Request, data: bytes, version: int, cache: str) -> Response:
    """The bytes with an ETag of the sample and table version; 304 when the client has it."""
    etag = '"' + hashlib.sha256(f"{request.path_params['sample_id']}@{version}".encode()
                                ).hexdigest()[:24] + '"'
    headers = {"ETag": etag, "Cache-Control": cache}
    if request.headers.get("if-none-match") == etag:
        return Response(status_code=304, headers=headers)
    return Response(data, media_type="image/jpeg", headers=headers)


def favicon(request: Request, state: BrowserState) -> Response:
    """The icon pages link to, also where browsers look for it unasked (no 404 logged)."""
    return Response((HERE / "static" / "favicon.svg").read_bytes(), media_type="image/svg+xml",
                    headers={"Cache-Control": THUMB_CACHE})


async def http_error(request: Request, exc: Exception, state: BrowserState) -> Response:
    """Starlette's own errors (no route, a method not allowed, the images' 404) as the
    browser's error page."""
    if not isinstance(exc, HTTPException):  # registered for HTTPException alone
        raise exc
    if exc.status_code == 404:
        return state.not_found(request, "nothing here")
    return state.error(request, exc.status_code, "Error", str(exc.detail))


# ------------------------------------------------------------------------------- the app

class Handler(Protocol):
    """A view: the request and the app's state in, a response out (async where it awaits
    the request's body); a function, whose name names its route."""

    __name__: str

    def __call__(self, request: Request, state: BrowserState
                 ) -> Response | Awaitable[Response]: ...


# (path, handler, methods): every URL the browser serves, besides /static.
ROUTES: list[tuple[str, Handler, tuple[str, ...]]] = [
    ("/", grid_page, ("GET",)),
    ("/sample/{sample_id}", sample_page, ("GET",)),
    ("/sample/{sample_id}/opt-out", opt_out_page, ("GET", "POST")),
    ("/duplicates", duplicates_page, ("GET",)),
    ("/rejected", rejected_page, ("GET",)),
    ("/random", random_sample, ("GET",)),
    ("/cards", cards_page, ("GET",)),
    ("/cards/{kind}/{name}", cards_page, ("GET",)),
    ("/thumb/{sample_id}", thumbnail_jpeg, ("GET",)),
    ("/image/{sample_id}", image_jpeg, ("GET",)),
    ("/reject-thumb/{sample_id}", reject_jpeg, ("GET",)),
    ("/original/{sample_id}", original_jpeg, ("GET",)),
    ("/favicon.ico", favicon, ("GET",)),
]


def routes(state: BrowserState) -> list[BaseRoute]:
    """ROUTES bound to one state, and the static files."""
    bound: list[BaseRoute] = [Route(path, partial(handler, state=state), methods=list(methods),
                                    name=handler.__name__)
                              for path, handler, methods in ROUTES]
    return [*bound, Mount("/static", StaticFiles(directory=HERE / "static"), name="static")]


def create_app(storage: Storage | str | Path, tokens: Tokens | None = None) -> Starlette:
    """The app over `storage` (a Storage, or its root folder / URI)."""
    state = BrowserState.create(storage, tokens)
    app = Starlette(routes=routes(state),
                    exception_handlers={HTTPException: partial(http_error, state=state)})
    app.state.browser = state
    app.state.catalog = state.catalog
    return app


def serve(storage: Storage | str | Path, host: str = "127.0.0.1", port: int = 8080) -> None:
    import uvicorn

    uvicorn.run(create_app(storage), host=host, port=port, log_level="info")
