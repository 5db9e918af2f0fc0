"""Header-only image profiling for ingest: format and size without decoding pixels.

Ingest must be cheap and must never crash on bad bytes, so every failure becomes a status
string. A full decode happens once, later, in the image stage.
"""

from __future__ import annotations

import hashlib
import io
import warnings
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

# Formats the pipeline accepts; anything else Pillow recognises is `unsupported_format`.
SUPPORTED_FORMATS = ("JPEG", "PNG", "WEBP")
DEFAULT_MAX_PIXELS = 200_000_000  # decompression-bomb cap (Pillow's own default is 89.5M)

STATUS_OK = "ok"
STATUS_EMPTY = "empty_file"
STATUS_UNREADABLE = "unreadable"
STATUS_NOT_IMAGE = "not_an_image"
STATUS_UNSUPPORTED = "unsupported_format"
STATUS_TRUNCATED = "truncated"
STATUS_TOO_MANY_PIXELS = "too_many_pixels"
STATUS_ZERO_AREA = "zero_area"
STATUS_UNSAFE_PATH = "unsafe_path"
STATUS_MISSING_IMAGE = "missing_image"


@dataclass(frozen=True)
class ProbeResult:
    status: str
    format: str | None = None
    width: int | None = None
    height: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == STATUS_OK


def probe_image(data: bytes | None, max_pixels: int = DEFAULT_MAX_PIXELS) -> ProbeResult:
    """Identify format and size from the header and check the file is complete."""
    if not data:
        return ProbeResult(STATUS_EMPTY, error="zero-byte file")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # bomb warnings: we apply our own cap below
            previous_cap = Image.MAX_IMAGE_PIXELS
            Image.MAX_IMAGE_PIXELS = None
            try:
                with Image.open(io.BytesIO(data)) as img:
                    fmt, (width, height) = img.format, img.size
            finally:
                Image.MAX_IMAGE_PIXELS = previous_cap
    except Exception as exc:
        return _unparseable(data, exc)
    if fmt not in SUPPORTED_FORMATS:
        return ProbeResult(STATUS_UNSUPPORTED, fmt, width, height, f"format {fmt} not accepted")
    if width <= 0 or height <= 0:
        return ProbeResult(STATUS_ZERO_AREA, fmt, width, height, f"size {width}x{height}")
    if width * height > max_pixels:
        return ProbeResult(
            STATUS_TOO_MANY_PIXELS, fmt, width, height,
            f"{width}x{height} exceeds the {max_pixels:,} pixel cap",
        )
    missing_end = _missing_end_marker(fmt, data)
    if missing_end:
        return ProbeResult(STATUS_TRUNCATED, fmt, width, height, missing_end)
    return ProbeResult(STATUS_OK, fmt, width, height)


def _format_from_magic(data: bytes) -> str | None:
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return None


def _unparseable(data: bytes, exc: Exception) -> ProbeResult:
    """The header did not parse: a cut-off file of a known format, or not an image at all."""
    fmt = _format_from_magic(data)
    if fmt is not None:
        missing_end = _missing_end_marker(fmt, data)
        if missing_end:
            return ProbeResult(STATUS_TRUNCATED, fmt, error=missing_end)
    if isinstance(exc, UnidentifiedImageError) and fmt is None:
        return ProbeResult(STATUS_NOT_IMAGE, error="not a recognised image format")
    return ProbeResult(STATUS_NOT_IMAGE, fmt, error=f"{type(exc).__name__}: {exc}"[:500])


def _missing_end_marker(fmt: str, data: bytes) -> str | None:
    """A cheap completeness test: the container's end marker must be present.

    Catches the common damage (cut-off downloads) without decoding; damage in the middle of
    the entropy-coded data is caught by the image stage's full decode.
    """
    if fmt == "JPEG":
        # EOI may be followed by padding or trailing junk; look near the end only.
        return None if b"\xff\xd9" in data[-4096:] else "JPEG has no end-of-image marker"
    if fmt == "PNG":
        return None if b"IEND" in data[-64:] else "PNG has no IEND chunk"
    if fmt == "WEBP":
        declared = int.from_bytes(data[4:8], "little") + 8
        return None if len(data) >= declared else f"WebP declares {declared} bytes, has {len(data)}"
    return None


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
