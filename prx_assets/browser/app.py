"""The corpus browser: a server-rendered Starlette app over the pipeline's Lance tables.

Views (each a few bounded Lance queries, see `queries`):

    /                         grid of thumbnails; ?q= full text, ?similar=ID more like this,
                              (&space=image: image embeddings), facets source/label/tier/
                              shape/dup/skip/concept (&level=, &concept=), ?page=
    /sample/{id}              one sample: full image, every caption version, labels, its
                              duplicate group, near duplicates, skip reasons, lineage
    /sample/{id}/opt-out      GET: the confirmation page; POST (a curator's session, same
                              origin, the session's form token, within its rate limit):
                              the request, recorded under the curator's name
    /concept/{level}/{c}      one concept cluster: its samples, size, captions and nearest
                              clusters (the `concepts` table)
    /login, /logout           a curator's session (see `auth`)
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
import hmac
import logging
import os
from collections.abc import Awaitable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlencode

import jinja2
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from prx_assets.browser import concepts, duplicates, queries, rejects
from prx_assets.browser.auth import (
    AUTH_DB,
    SESSION_COOKIE,
    BrowserAuth,
    Curators,
    is_loopback,
    same_origin,
)
from prx_assets.browser.cards import published, tree_card
from prx_assets.browser.catalog import TABLE_TTL_S, BadQuery, Catalog, NotFound
from prx_assets.browser.facets import MAX_CLUSTER, MAX_CONCEPT_LEVEL, Query
from prx_assets.browser.links import dagster_home_instance, dagster_url, run_url
from prx_assets.stages.ingest.rights import CONSTRAINED
from prx_assets.stages.opt_outs.requests import files_requesting, write_request
from prx_assets.stages.opt_outs.rights import clear
from prx_assets.storage.layout import Storage
from prx_assets.storage.tables import BUCKETED_IMAGES, CAPTIONS

HERE = Path(__file__).parent
# Immutable per corpus version: the ETag names the version, so a rebuilt corpus is refetched.
THUMB_CACHE = "public, max-age=86400"
IMAGE_CACHE = "public, max-age=3600"
ORIGINAL_PX = 1024  # the original beside the bucketed crop, at most this on its longest side
# Paths a visitor reaches without a session where reading needs one (a non-loopback bind).
OPEN_PATHS = ("/login", "/static/", "/favicon.ico")
logger = logging.getLogger(__name__)


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


def concept_page(request: Request, state: BrowserState) -> Response:
    """One concept cluster: its samples, size, a few captions, its nearest clusters."""
    level, cluster = request.path_params["level"], request.path_params["cluster"]
    if level > MAX_CONCEPT_LEVEL or cluster > MAX_CLUSTER:  # beyond a Lance int32 filter
        return state.error(request, 400, "Bad request", f"a concept is a level up to "
                           f"{MAX_CONCEPT_LEVEL} and a cluster up to {MAX_CLUSTER}")
    try:
        found = concepts.cluster(state.catalog, level, cluster, queries.PAGE_SIZE)
        tiles = queries.tiles_of(state.catalog, found.ids)
    except NotFound as err:
        return state.not_found(request, str(err))
    return state.render(request, "concept.html", c=found, tiles=tiles)


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
    return state.render(request, "sample.html", s=found,
                        dagster=sample_run_url(found, state.dagster),
                        requested=files_requesting(state.catalog.storage, found.id),
                        opted=request.query_params.get("opted") == "1")


def sample_run_url(found: queries.Sample, instance: Any) -> str:
    """The run that wrote the sample's newest caption, else its image stage's asset page."""
    source = found.row["source"]
    if found.captions and found.captions[0].get("created_at"):
        return run_url(CAPTIONS, source, found.captions[0]["created_at"], instance)
    return dagster_url(BUCKETED_IMAGES, source)


async def opt_out_page(request: Request, state: BrowserState) -> Response:
    """GET: the confirmation page (a log-in link without a session). POST: when
    `write_refusal` finds nothing wrong and the box is ticked, one new request file under
    the curator's name, then back to the sample page."""
    try:
        row = await run_in_threadpool(queries.corpus_row, state.catalog,
                                      request.path_params["sample_id"],
                                      ["id", "source", "caption"])
    except NotFound as err:
        return state.not_found(request, str(err))
    session = state.auth.session(request)
    if request.method == "GET":
        return state.render(request, "optout.html", row=row, session=session)
    form = await confirmed_form(request, state, "opt this image out")
    if isinstance(form, Response):
        logger.warning(f"opt-out of {row['id']} refused: {form.status_code}")
        return form
    assert session is not None  # confirmed_form refuses a request without one
    written = await run_in_threadpool(write_request, state.catalog.storage, row["id"],
                                      str(form.get("reference", "")),
                                      requested_by=session.curator, door="browser")
    logger.info(f"opt-out of {row['id']} by curator {session.curator}: {written.name}")
    return RedirectResponse(f"/sample/{row['id']}?opted=1", status_code=303)


async def clear_rights_page(request: Request, state: BrowserState) -> Response:
    """A curator's clearance of a constrained training reservation (docs/rights.md),
    through the opt-out door's checks: GET the confirmation page, POST one new clearance
    file under the curator's name. A prohibition cannot be cleared."""
    try:
        row = await run_in_threadpool(queries.corpus_row, state.catalog,
                                      request.path_params["sample_id"],
                                      ["id", "source", "caption", "reservation"])
    except NotFound as err:
        return state.not_found(request, str(err))
    if row.get("reservation") != CONSTRAINED:
        return state.error(request, 409, "Nothing to clear",
                           f"{row['id']} has reservation {row.get('reservation') or 'none'}: "
                           "only a constrained one can be cleared")
    session = state.auth.session(request)
    if request.method == "GET":
        return state.render(request, "clearrights.html", row=row, session=session)
    form = await confirmed_form(request, state, "clear this reservation")
    if isinstance(form, Response):
        return form
    assert session is not None  # confirmed_form refuses a request without one
    written = await run_in_threadpool(clear, state.catalog.storage, [row["id"]],
                                      str(form.get("reference", "")), door="browser",
                                      cleared_by=session.curator)
    logger.info(f"rights clearance of {row['id']} by curator {session.curator}: "
                f"{written.name}")
    return RedirectResponse(f"/sample/{row['id']}?cleared=1", status_code=303)


async def confirmed_form(request: Request, state: BrowserState, action: str
                         ) -> FormData | Response:
    """A curator's POSTed form when it may write (`write_refusal`) and its confirmation box
    is ticked; else the response saying why not."""
    form = await request.form()
    refusal = write_refusal(request, state, str(form.get("token", "")))
    if refusal is not None:
        return refusal
    if form.get("confirm") != "yes":
        return state.error(request, 400, "Not confirmed",
                           f"tick the confirmation box to {action}")
    return form


def write_refusal(request: Request, state: BrowserState, form_token: str) -> Response | None:
    """Why this write may not happen (a response saying so), None when it may: a curator's
    session, this server's origin, the session's form token, the curator's rate limit."""
    auth = state.auth
    if not auth.configured:
        return state.error(request, 403, "Writing is off", "this browser was started "
                           "without curator tokens (PRX_CURATOR_TOKENS): it only reads")
    session = auth.session(request)
    if session is None:
        return state.error(request, 401, "Log in", "writing needs a curator: log in first")
    if not same_origin(request):
        return state.error(request, 403, "Forbidden", "the request does not come from a "
                           "page of this server")
    if not hmac.compare_digest(session.form_token, form_token):
        return state.error(request, 403, "Forbidden", "the form's token is missing or "
                           "wrong: open the page again and retry")
    if not auth.writes.allow(session.curator):
        return state.error(request, 429, "Too many requests",
                           f"{session.curator}: rate limit of {auth.writes.limit} writes per "
                           f"{auth.writes.window_s:.0f} s reached; retry later")
    return None


async def login_page(request: Request, state: BrowserState) -> Response:
    """GET: the form. POST (same origin, within the client's log-in limit): a session
    cookie for the token's curator, then on to `next` (a local path)."""
    target = _local_path(request.query_params.get("next", "/"))
    if request.method == "GET":
        return state.render(request, "login.html", next=target, message="")
    form = await request.form()
    target = _local_path(str(form.get("next", "/")))
    if not state.auth.configured:
        return state.error(request, 403, "Writing is off", "no curator tokens configured")
    if not same_origin(request):
        return state.error(request, 403, "Forbidden", "the log-in does not come from a "
                           "page of this server")
    client = request.client.host if request.client else "unknown"
    if not state.auth.logins.allow(client):
        return state.error(request, 429, "Too many requests", "too many log-in attempts; "
                           "retry later")
    curator = state.auth.curators.who(str(form.get("token", ""))) \
        if state.auth.curators else None
    if curator is None:
        logger.warning(f"failed curator log-in from {client}")
        return state.render(request, "login.html", status=401, next=target,
                            message="unknown token")
    logger.info(f"curator {curator} logged in from {client}")
    response = RedirectResponse(target, status_code=303)
    response.set_cookie(**state.auth.cookie(state.auth.sessions.start(curator)))
    return response


def logout(request: Request, state: BrowserState) -> Response:
    state.auth.sessions.end(request.cookies.get(SESSION_COOKIE))
    response = RedirectResponse("/", status_code=303)
    response.delete_cookie(SESSION_COOKIE, path="/")
    return response


def _local_path(target: str) -> str:
    """`target` if it is a path on this server (no scheme, host or `//`), else `/`."""
    return target if target.startswith("/") and not target.startswith("//") else "/"


def duplicates_page(request: Request, state: BrowserState) -> Response:
    page_text = request.query_params.get("page", "0")
    if not page_text.isdigit() or int(page_text) > 100_000:
        return state.error(request, 400, "Bad request", "page must be a small number")
    try:
        near = duplicates.near_clusters(state.catalog)
    except NotFound as err:
        return state.not_found(request, str(err))
    groups, total = duplicates.exact_groups(state.catalog, int(page_text))
    semantic, semantic_total = duplicates.semantic_groups(state.catalog, int(page_text))
    return state.render(request, "duplicates.html", near=near[:100], near_total=len(near),
                        groups=groups, groups_total=total, page=int(page_text),
                        semantic=semantic, semantic_total=semantic_total)


def rejected_page(request: Request, state: BrowserState) -> Response:
    params = request.query_params
    page_text = params.get("page", "0")
    if not page_text.isdigit() or int(page_text) > 100_000:
        return state.error(request, 400, "Bad request", "page must be a small number")
    try:
        counts = rejects.reject_counts(state.catalog)
        # Without a reason the page opens on the largest one, across sources.
        reason = params.get("reason") or rejects.largest_reason(counts)
        page = (rejects.rejects(state.catalog, reason, params.get("source", ""),
                                int(page_text)) if reason else None)
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
    ("/sample/{sample_id}/clear-rights", clear_rights_page, ("GET", "POST")),
    ("/concept/{level:int}/{cluster:int}", concept_page, ("GET",)),
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
    ("/login", login_page, ("GET", "POST")),
    ("/logout", logout, ("POST",)),
]


def routes(state: BrowserState) -> list[BaseRoute]:
    """ROUTES bound to one state, and the static files."""
    bound: list[BaseRoute] = [Route(path, partial(handler, state=state), methods=list(methods),
                                    name=handler.__name__)
                              for path, handler, methods in ROUTES]
    return [*bound, Mount("/static", StaticFiles(directory=HERE / "static"), name="static")]


class ReadsNeedLogin(BaseHTTPMiddleware):
    """Where reading is private (a non-loopback bind), every page but the log-in needs a
    session."""

    def __init__(self, app, state: BrowserState) -> None:
        super().__init__(app)
        self.state = state

    async def dispatch(self, request: Request, call_next: RequestResponseEndpoint
                       ) -> Response:
        if (self.state.private_reads and not request.url.path.startswith(OPEN_PATHS)
                and self.state.auth.session(request) is None):
            return RedirectResponse(f"/login?{urlencode({'next': request.url.path})}",
                                    status_code=303)
        return await call_next(request)


def create_app(storage: Storage | str | Path, auth: BrowserAuth | None = None,
               private_reads: bool = False, dagster: Any = None,
               table_ttl_s: float = TABLE_TTL_S) -> Starlette:
    """The app over `storage` (a Storage, or its root folder / URI); `auth` says who may
    write (default: nobody); `dagster`, the instance its sample pages find the exact
    writing run in; `table_ttl_s`, how long an opened table is served before its latest
    version is checked again."""
    state = BrowserState.create(storage, auth, private_reads, dagster, table_ttl_s)
    app = Starlette(routes=routes(state),
                    middleware=[Middleware(ReadsNeedLogin, state=state)],
                    exception_handlers={HTTPException: partial(http_error, state=state)})
    app.state.browser = state
    app.state.catalog = state.catalog
    return app


class UnsafeBind(ValueError):
    """A non-loopback bind without curator auth: anyone on the network could write."""


def serve(storage: Storage | str | Path, host: str = "127.0.0.1", port: int = 8080,
          curators: Curators | None = None) -> None:
    """Serve the browser. On a loopback address reading is open and writing needs a
    curator (none configured: read-only); any other address needs curators, and then
    reading needs a session too."""
    import uvicorn

    app = create_app(storage, browser_auth(curators), private_reads=check_bind(host, curators),
                     dagster=dagster_home_instance())
    uvicorn.run(app, host=host, port=port, log_level="info")


def browser_auth(curators: Curators | None) -> BrowserAuth:
    """Sessions and rate limits in a SQLite file beside the Dagster instance
    ($DAGSTER_HOME/browser_auth.sqlite): kept across a restart and shared by every server
    process started there; in this process's memory without DAGSTER_HOME."""
    home = os.environ.get("DAGSTER_HOME")
    return BrowserAuth.shared(curators, Path(home) / AUTH_DB) if home else BrowserAuth(curators)


def check_bind(host: str, curators: Curators | None) -> bool:
    """Whether reading needs a session at `host`; UnsafeBind where it may not be served."""
    if is_loopback(host):
        return False
    if curators is None:
        raise UnsafeBind(f"refusing to serve on {host}: a non-loopback address needs curator "
                         "tokens (set PRX_CURATOR_TOKENS to a token file, or bind 127.0.0.1)")
    return True
