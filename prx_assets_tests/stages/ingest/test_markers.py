"""The container walk that finds XMP and JUMBF: the JPEG walk (the one most files pay, with
its shortcuts: one test for the common segment, a shared answer for a file without either)
against the walk as ISO 10918-1 B.1.1 describes it, on seeded mutants of a real header."""

from __future__ import annotations

import random

from prx_assets.stages.ingest.markers import XMP_JPEG_HEADER, find_markers
from prx_assets.testing import rights_fixtures as rf


def _reference(data: bytes, visited: list[int] | None = None
               ) -> tuple[bytes | None, list[bytes]]:
    """Markers are 0xFF and a code; 0xFF before a marker is fill; SOI, TEM and RSTm have no
    length; the metadata segments end at the start of scan (or an end of image). The
    positions the walk steps on go to `visited`."""
    xmp, jumbf, pos = None, [], 2
    while pos + 4 <= len(data) and data[pos] == 0xFF:
        if visited is not None:
            visited.append(pos)
        marker = data[pos + 1]
        if marker == 0xFF:
            pos += 1
        elif marker in (0x01, 0xD8) or 0xD0 <= marker <= 0xD7:
            pos += 2
        elif marker in (0xD9, 0xDA):
            break
        else:
            end = pos + 2 + int.from_bytes(data[pos + 2:pos + 4], "big")
            payload = data[pos + 4:end]
            if marker == 0xE1 and xmp is None and payload.startswith(XMP_JPEG_HEADER):
                xmp = payload[len(XMP_JPEG_HEADER):]
            elif marker == 0xEB and payload.startswith(b"JP"):
                jumbf.append(payload)
            pos = end
    return xmp, jumbf


def _segment(marker: int, payload: bytes) -> bytes:
    return bytes((0xFF, marker)) + (len(payload) + 2).to_bytes(2, "big") + payload


_XMP = _segment(0xE1, XMP_JPEG_HEADER + b"<x:xmpmeta xmlns:x='adobe:ns:meta/'/>")
_JUMBF = _segment(0xEB, b"JP\x00\x01\x00\x00\x00\x01" + b"\x00" * 24)
# Pieces a mutation inserts: whole metadata segments, fill, bytes that break the chain,
# and each marker without a length, or that ends the walk, followed by what would read as
# an empty segment's length (a walk that took it for a segment would go on).
_PIECES = [_XMP, _JUMBF, _segment(0xE1, b"Exif\x00\x00"), _segment(0xFE, b"a comment"),
           b"\xff", b"\xff\xff", b"\x00", b"\x7f", b"\xff\x00", b"\xff\xe1\x00",
           b"\xff\xeb\x00\x02", *(bytes((0xFF, marker, 0, 2)) for marker in
                                 (0x01, *range(0xD0, 0xDB)))]


def _mutant(base: bytes, rng: random.Random) -> bytes:
    """One to three edits, mostly where the walk steps (a random byte rarely matters)."""
    data = base
    for _ in range(rng.choice((1, 2, 3))):
        steps: list[int] = []
        _reference(data, steps)
        at = rng.choice(steps) if steps and rng.random() < 0.7 else rng.randrange(2, 600)
        edit = rng.randrange(4)
        if edit < 2:  # segments and markers go in most
            data = data[:at] + rng.choice(_PIECES) + data[at:]
        elif edit == 2:
            data = data[:at] + data[at + rng.randint(1, 8):]
        else:
            data = data[:at] + bytes((rng.randrange(256),)) + data[at + 1:]
    return data


def test_the_jpeg_walk_agrees_with_the_reference_on_mutants():
    photo = rf.photo("jpeg", 32)
    base = photo[:2] + _XMP + _JUMBF + photo[2:]
    rng = random.Random(46)
    found = {"xmp": 0, "jumbf": 0, "neither": 0}
    for _ in range(2000):
        data = _mutant(base, rng)
        markers = find_markers(data)
        xmp, jumbf = _reference(data)
        assert (markers.xmp, [bytes(part) for part in markers.jumbf]) == (xmp, jumbf), data
        found["xmp"] += xmp is not None
        found["jumbf"] += bool(jumbf)
        found["neither"] += xmp is None and not jumbf
    # The mutants reach every answer: a packet, manifest segments, and neither.
    assert min(found.values()) > 100, found
