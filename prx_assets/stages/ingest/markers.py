"""Where an image file keeps its metadata: a walk of the container's segment or chunk headers
(JPEG, PNG, WebP; no pixel data read) that finds the XMP packet and the JUMBF boxes of a
C2PA manifest store. Every ingested file pays this walk, so it copies only the XMP packet
(the JUMBF segments, often 100 KB and more with the manifest's thumbnail, are views of the
bytes) and a file without either gets a shared empty answer."""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

XMP_JPEG_HEADER = b"http://ns.adobe.com/xap/1.0/\x00"
XMP_PNG_KEYWORD = b"XML:com.adobe.xmp"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# A JPEG segment's marker and length; a PNG chunk's length and type; a WebP chunk's.
_JPEG_SEGMENT, _PNG_CHUNK, _WEBP_CHUNK = (struct.Struct(">BBH"), struct.Struct(">I4s"),
                                          struct.Struct("<4sI"))


@dataclass(frozen=True)
class Markers:
    """Where metadata sits in the container: the XMP packet (bytes), the segments or chunks
    that hold a C2PA manifest store (JUMBF: JPEG APP11 segments, a PNG `caBX` or WebP `C2PA`
    chunk; empty without one), and the MIME type c2pa-python reads it as."""

    xmp: bytes | None = None
    jumbf: tuple[bytes | memoryview, ...] = ()
    mime: str | None = None


# What most files have: no XMP, no JUMBF (shared, not built per file).
_NOTHING = {mime: Markers(mime=mime) for mime in ("image/jpeg", "image/png", "image/webp")}
# JPEG markers without a length: TEM, RST0-7, SOI (a walk steps over them).
_JPEG_NO_LENGTH = frozenset({0x01, 0xD8, *range(0xD0, 0xD8)})
# Those, a fill byte, and the two a walk stops at: start of scan, end of image.
_JPEG_NOT_A_SEGMENT = _JPEG_NO_LENGTH | {0xFF, 0xDA, 0xD9}


def find_markers(data: bytes) -> Markers:
    """Walk the container's segment or chunk headers (no pixel data read)."""
    try:
        if data[:2] == b"\xff\xd8":
            return _jpeg_markers(data)
        if data[:8] == PNG_SIGNATURE:
            return _png_markers(data)
        if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
            return _webp_markers(data)
    except (struct.error, IndexError, zlib.error):
        return Markers()  # a broken container: the probe rejects the image
    return Markers()


def _jpeg_markers(data: bytes) -> Markers:
    xmp, pos, size = None, 2, len(data)
    jumbf: list[memoryview] = []
    unpack = _JPEG_SEGMENT.unpack_from
    while pos + 4 <= size:
        fill, marker, length = unpack(data, pos)
        if fill != 0xFF:
            break
        if marker in _JPEG_NOT_A_SEGMENT:  # one test for the common case, a segment
            if marker == 0xFF:  # fill byte
                pos += 1
                continue
            if marker in _JPEG_NO_LENGTH:
                pos += 2
                continue
            break  # start of scan or end of image: no metadata segments past it
        end = pos + 2 + length
        # Only the two segments read are kept: the walk is what every JPEG pays.
        if marker == 0xE1 and xmp is None and data.startswith(XMP_JPEG_HEADER, pos + 4, end):
            xmp = data[pos + 4 + len(XMP_JPEG_HEADER):end]
        elif marker == 0xEB and data.startswith(b"JP", pos + 4, end):  # APP11: JUMBF (C2PA)
            jumbf.append(memoryview(data)[pos + 4:end])
        pos = end
    if xmp is None and not jumbf:
        return _NOTHING["image/jpeg"]
    return Markers(xmp=xmp, jumbf=tuple(jumbf), mime="image/jpeg")


def _png_markers(data: bytes) -> Markers:
    xmp, pos = None, 8
    jumbf: list[memoryview] = []
    while pos + 8 <= len(data):
        length, kind = _PNG_CHUNK.unpack_from(data, pos)
        if kind == b"iTXt" and xmp is None:
            body = data[pos + 8:pos + 8 + length]
            if body.startswith(XMP_PNG_KEYWORD + b"\x00"):
                xmp = _itxt_text(body)
        elif kind == b"caBX":
            jumbf.append(memoryview(data)[pos + 8:pos + 8 + length])
        elif kind == b"IEND":
            break
        pos += 12 + length
    if xmp is None and not jumbf:
        return _NOTHING["image/png"]
    return Markers(xmp=xmp, jumbf=tuple(jumbf), mime="image/png")


def _itxt_text(body: bytes) -> bytes:
    """keyword NUL, compression flag, method, language NUL, translated keyword NUL, text."""
    rest = body[len(XMP_PNG_KEYWORD) + 1:]
    compressed = rest[0] == 1
    text = rest[2:].split(b"\x00", 2)[2]
    return zlib.decompress(text) if compressed else text


def _webp_markers(data: bytes) -> Markers:
    xmp, pos = None, 12
    jumbf: list[memoryview] = []
    while pos + 8 <= len(data):
        kind, length = _WEBP_CHUNK.unpack_from(data, pos)
        if kind == b"XMP ":
            xmp = data[pos + 8:pos + 8 + length]
        elif kind == b"C2PA":
            jumbf.append(memoryview(data)[pos + 8:pos + 8 + length])
        pos += 8 + length + (length & 1)
    if xmp is None and not jumbf:
        return _NOTHING["image/webp"]
    return Markers(xmp=xmp, jumbf=tuple(jumbf), mime="image/webp")
