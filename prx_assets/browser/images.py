"""The browser's image bytes: thumbnails, bucketed images, rejected images and originals,
as JPEG with an ETag of the sample and table version and caching headers."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from functools import partial

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from prx_assets.browser import queries, rejects
from prx_assets.browser.catalog import NotFound
from prx_assets.browser.state import HERE, BrowserState

# Immutable per corpus version: the ETag names the version, so a rebuilt corpus is refetched.
THUMB_CACHE = "public, max-age=86400"
IMAGE_CACHE = "public, max-age=3600"
ORIGINAL_PX = 1024  # the original beside the bucketed crop, at most this on its longest side


def thumbnail_jpeg(request: Request, state: BrowserState) -> Response:
    return _served(request, partial(queries.thumbnail, state.catalog), THUMB_CACHE)


def image_jpeg(request: Request, state: BrowserState) -> Response:
    return _served(request, partial(queries.full_image, state.catalog), IMAGE_CACHE)


def reject_jpeg(request: Request, state: BrowserState) -> Response:
    return _served(request, partial(rejects.reject_thumbnail, state.catalog), IMAGE_CACHE)


def original_jpeg(request: Request, state: BrowserState) -> Response:
    """The sample's original (its raw bytes, before the crop to its bucket), downscaled."""
    return _served(request, lambda sample_id: rejects.raw_preview(state.catalog, sample_id,
                                                                  ORIGINAL_PX), IMAGE_CACHE)


def _served(request: Request, read: Callable[[str], tuple[bytes, int]], cache: str
            ) -> Response:
    """The JPEG `read` finds for the path's sample id (bytes and table version); 404 when
    it finds none."""
    try:
        data, version = read(request.path_params["sample_id"])
    except NotFound:
        raise HTTPException(404) from None
    return _jpeg(request, data, version, cache)


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
