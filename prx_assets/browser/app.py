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

Each view is a handler function of the request and the app's `BrowserState` (`state`: its
tables, who may write, templates): the reading pages here, the curators' log-in and writes
in `curation`, the image bytes in `images`; `ROUTES` maps the URLs to them and
`create_app` binds them to one state. Path parameters are sample ids, validated and looked
up in tables; nothing from a request is joined into a file path. Templates autoescape everything.

Handlers are plain functions, which Starlette runs in its thread pool: Lance queries block
(and release the GIL), so the thumbnails of one page are read in parallel rather than one
after another on the event loop. The opt-out handler is async only to read its form.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable
from functools import partial
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlencode

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from prx_assets.browser import concepts, duplicates, queries, rejects
from prx_assets.browser.auth import (
    AUTH_DB,
    BrowserAuth,
    Curators,
    is_loopback,
)
from prx_assets.browser.cards import published, tree_card
from prx_assets.browser.catalog import TABLE_TTL_S, BadQuery, NotFound
from prx_assets.browser.curation import (
    clear_rights_page,
    login_page,
    logout,
    opt_out_page,
)
from prx_assets.browser.facets import MAX_CLUSTER, MAX_CONCEPT_LEVEL, Query
from prx_assets.browser.images import (
    favicon,
    image_jpeg,
    original_jpeg,
    reject_jpeg,
    thumbnail_jpeg,
)
from prx_assets.browser.links import dagster_home_instance, dagster_url, run_url
from prx_assets.browser.state import HERE, BrowserState
from prx_assets.stages.opt_outs.requests import files_requesting
from prx_assets.storage.layout import Storage
from prx_assets.storage.tables import BUCKETED_IMAGES, CAPTIONS

# Paths a visitor reaches without a session where reading needs one (a non-loopback bind).
OPEN_PATHS = ("/login", "/static/", "/favicon.ico")


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
