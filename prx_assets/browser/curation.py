"""The curators' views: log in and out, and the writes a session may make (an opt-out
request, the clearance of a constrained training reservation), each behind the same
checks (`write_refusal`: a session, this server's origin, the session's form token, the
curator's rate limit) and recorded under the curator's name."""

from __future__ import annotations

import hmac
import logging

from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from prx_assets.browser import queries
from prx_assets.browser.auth import SESSION_COOKIE, same_origin
from prx_assets.browser.catalog import NotFound
from prx_assets.browser.state import BrowserState
from prx_assets.stages.ingest.rights import CONSTRAINED
from prx_assets.stages.opt_outs.requests import write_request
from prx_assets.stages.opt_outs.rights import clear

logger = logging.getLogger(__name__)


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
