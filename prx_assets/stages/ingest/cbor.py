"""A strict CBOR (RFC 8949) decoder for the small documents C2PA manifests hold (a claim, a
training-mining assertion): definite lengths, text or integer map keys, no tags.
Anything else — an indefinite length, a tag, a duplicate key, bad UTF-8, a
truncated item, bytes after the item — is a `CborError`, so a caller that must be certain
of what it read can fall back to a full reader instead of guessing.
"""

from __future__ import annotations

import struct

MAX_DEPTH = 32
_FLOATS = {25: (">e", 2), 26: (">f", 4), 27: (">d", 8)}
_SIMPLE = {20: False, 21: True, 22: None}


class CborError(ValueError):
    """The bytes are not one well-formed item of the subset this decoder reads."""


def loads(data: bytes) -> object:
    """The one item `data` holds."""
    try:
        value, end = _item(data, 0, 0)
    except (IndexError, struct.error) as exc:
        raise CborError(f"truncated ({exc})") from None
    if end != len(data):
        raise CborError(f"{len(data) - end} bytes after the item")
    return value


def _head(data: bytes, pos: int) -> tuple[int, int, int, int]:
    """(major type, additional info, argument, position after the head)."""
    initial = data[pos]
    major, info = initial >> 5, initial & 0x1F
    if info < 24:
        return major, info, info, pos + 1
    if info > 27:  # 28-30 reserved, 31 indefinite length
        raise CborError(f"additional information {info} at {pos}")
    end = pos + 1 + (1 << (info - 24))
    if end > len(data):
        raise CborError(f"truncated head at {pos}")
    return major, info, int.from_bytes(data[pos + 1:end], "big"), end


def _item(data: bytes, pos: int, depth: int) -> tuple[object, int]:
    if depth > MAX_DEPTH:
        raise CborError("nested too deep")
    major, info, arg, pos = _head(data, pos)
    if major == 0:
        return arg, pos
    if major == 1:
        return -1 - arg, pos
    if major in (2, 3):
        end = pos + arg
        if end > len(data):
            raise CborError(f"string runs past the end at {pos}")
        if major == 2:
            return data[pos:end], end
        try:
            return data[pos:end].decode("utf-8"), end
        except UnicodeDecodeError as exc:
            raise CborError(f"text not UTF-8 at {pos}") from exc
    if major == 4:
        if arg > len(data) - pos:
            raise CborError(f"array of {arg} items runs past the end")
        items = []
        for _ in range(arg):
            value, pos = _item(data, pos, depth + 1)
            items.append(value)
        return items, pos
    if major == 5:
        return _map(data, pos, arg, depth)
    if major == 6:
        raise CborError(f"tag {arg} at {pos}")
    return _simple(data, pos, info)


def _map(data: bytes, pos: int, count: int, depth: int) -> tuple[dict, int]:
    if count > len(data) - pos:
        raise CborError(f"map of {count} pairs runs past the end")
    out: dict = {}
    for _ in range(count):
        key, pos = _item(data, pos, depth + 1)
        if type(key) not in (str, int):
            raise CborError(f"map key of type {type(key).__name__}")
        if key in out:
            raise CborError(f"duplicate map key {key!r}")
        out[key], pos = _item(data, pos, depth + 1)
    return out, pos


def _simple(data: bytes, pos: int, info: int) -> tuple[object, int]:
    if info in _SIMPLE:
        return _SIMPLE[info], pos
    if info in _FLOATS:
        fmt, size = _FLOATS[info]
        return struct.unpack(fmt, data[pos - size:pos])[0], pos
    raise CborError(f"simple value {info}")
