"""The corpus browser: a server-rendered Starlette app over the pipeline's Lance tables.

Views (each a few bounded Lance queries, see `queries`):

    /                         grid of thumbnails; ?q= full text, ?similar=ID more like this,
                              facets source/label/tier/shape/dup/skip, ?page=
    /sample/{id}              one sample: full image, every caption version, labels, its
                              duplicate group, near duplicates, skip reasons, lineage
    /sample/{id}/opt-out      GET: the confirmation page; POST (page token): the request
    /duplicates               near-duplicate clusters (Hamming 1-4) and exact groups
    /random                   redirect to a random sample
    /thumb/{id}, /image/{id}  JPEG bytes (thumbnail from `corpus`, full from
                              `bucketed_images`), with caching headers

Path parameters are sample ids, validated and looked up in tables; nothing from a request
is joined into a file path. Templates autoescape everything.

Views are plain functions, which Starlette runs in its thread pool: Lance queries block (and
release the GIL), so the thumbnails of one page are read in parallel rather than one after
another on the event loop.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from urllib.parse import urlencode

import jinja2
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from prx_assets.browser import queries
from prx_assets.browser.optout import Tokens, pending_requests, write_request
from prx_assets.storage.layout import Storage

HERE = Path(__file__).parent
# Immutable per corpus version: the ETag names the version, so a rebuilt corpus is refetched.
THUMB_CACHE = "public, max-age=86400"
IMAGE_CACHE = "public, max-age=3600"


def create_app(storage: Storage | str | Path, tokens: Tokens | None = None) -> Starlette:
    """The app over `storage` (a Storage, or its root folder / URI)."""
    catalog = queries.Catalog(storage)
    tokens = tokens or Tokens()
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"),
                             autoescape=True, undefined=jinja2.StrictUndefined)
    env.globals["urlencode"] = urlencode

    def render(request: Request, template: str, status: int = 200, **context) -> HTMLResponse:
        html = env.get_template(template).render(request=request, **context)
        return HTMLResponse(html, status_code=status)

    def not_found(request: Request, message: str) -> HTMLResponse:
        return render(request, "error.html", status=404, title="Not found", message=message)

    def home(request: Request) -> Response:
        try:
            query = queries.Query.parse(dict(request.query_params))
        except queries.BadQuery as err:
            return render(request, "error.html", status=400, title="Bad request",
                          message=str(err))
        except queries.NotFound as err:
            return not_found(request, str(err))
        try:
            result = queries.grid(catalog, query)
            info = queries.overview(catalog)
        except queries.NotFound as err:
            return not_found(request, str(err))
        return render(request, "grid.html", query=query, grid=result, info=info,
                      page_size=queries.PAGE_SIZE, max_hits=queries.MAX_SEARCH_HITS,
                      max_facet_rows=queries.MAX_FACET_ROWS)

    def sample(request: Request) -> Response:
        sample_id = request.path_params["sample_id"]
        try:
            found = queries.sample(catalog, sample_id)
        except queries.NotFound as err:
            return not_found(request, str(err))
        return render(request, "sample.html", s=found, token=tokens.token(found.id),
                      requested=pending_requests(catalog.storage, found.id),
                      opted=request.query_params.get("opted") == "1")

    async def opt_out(request: Request) -> Response:
        sample_id = request.path_params["sample_id"]
        try:
            row = await run_in_threadpool(queries.corpus_row, catalog, sample_id,
                                          ["id", "source", "caption"])
        except queries.NotFound as err:
            return not_found(request, str(err))
        if request.method == "GET":
            return render(request, "optout.html", row=row, token=tokens.token(row["id"]))
        form = await request.form()
        if not tokens.valid(row["id"], str(form.get("token", ""))):
            return render(request, "error.html", status=403, title="Forbidden",
                          message="the opt-out form's token is missing or wrong: open the "
                                  "sample page and try again")
        if form.get("confirm") != "yes":
            return render(request, "error.html", status=400, title="Not confirmed",
                          message="tick the confirmation box to opt this image out")
        await run_in_threadpool(write_request, catalog.storage, row["id"],
                                str(form.get("reference", "")))
        return RedirectResponse(f"/sample/{row['id']}?opted=1", status_code=303)

    def duplicates(request: Request) -> Response:
        page_text = request.query_params.get("page", "0")
        if not page_text.isdigit() or int(page_text) > 100_000:
            return render(request, "error.html", status=400, title="Bad request",
                          message="page must be a small number")
        try:
            near = queries.near_clusters(catalog)
        except queries.NotFound as err:
            return not_found(request, str(err))
        groups, total = queries.exact_groups(catalog, int(page_text))
        return render(request, "duplicates.html", near=near[:100], near_total=len(near),
                      groups=groups, groups_total=total, page=int(page_text))

    def random_sample(request: Request) -> Response:
        try:
            sample_id = queries.random_id(catalog)
        except queries.NotFound as err:
            return not_found(request, str(err))
        return RedirectResponse(f"/sample/{sample_id}", status_code=303)

    def _jpeg(request: Request, data: bytes, version: int, cache: str) -> Response:
        etag = '"' + hashlib.sha256(f"{request.path_params['sample_id']}@{version}".encode()
                                    ).hexdigest()[:24] + '"'
        headers = {"ETag": etag, "Cache-Control": cache}
        if request.headers.get("if-none-match") == etag:
            return Response(status_code=304, headers=headers)
        return Response(data, media_type="image/jpeg", headers=headers)

    def thumb(request: Request) -> Response:
        try:
            data, version = queries.thumbnail(catalog, request.path_params["sample_id"])
        except queries.NotFound:
            raise HTTPException(404)
        return _jpeg(request, data, version, THUMB_CACHE)

    def image(request: Request) -> Response:
        try:
            data, version = queries.full_image(catalog, request.path_params["sample_id"])
        except queries.NotFound:
            raise HTTPException(404)
        return _jpeg(request, data, version, IMAGE_CACHE)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        if exc.status_code == 404:
            return not_found(request, "nothing here")
        return render(request, "error.html", status=exc.status_code, title="Error",
                      message=str(exc.detail))

    routes = [
        Route("/", home),
        Route("/sample/{sample_id}", sample),
        Route("/sample/{sample_id}/opt-out", opt_out, methods=["GET", "POST"]),
        Route("/duplicates", duplicates),
        Route("/random", random_sample),
        Route("/thumb/{sample_id}", thumb),
        Route("/image/{sample_id}", image),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error})
    app.state.catalog = catalog
    return app


def serve(storage: Storage | str | Path, host: str = "127.0.0.1", port: int = 8080) -> None:
    import uvicorn

    uvicorn.run(create_app(storage), host=host, port=port, log_level="info")

