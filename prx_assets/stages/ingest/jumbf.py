"""C2PA training-mining assertions read straight from a manifest store's JUMBF boxes
(ISO 19566-5; C2PA 2.x, "Manifest store"), without a full manifest parse.

c2pa-python's reader parses the whole image and manifest (claims, certificates, JSON for
every assertion); a "do not train" answer needs one small CBOR assertion out of it.
`training_mining_store` walks the box headers, decodes each manifest's
`*.training-mining` assertions (strict CBOR: `cbor.py`) and returns them in the shape of
c2pa's JSON, for `rights.training_mining_findings`.

It answers only when it is certain of what it read. Any layout it does not expect — a JPEG
store split over segments out of order or beside other JUMBF, a second store, a box that
runs past its parent, an unknown box where a manifest's parts sit, two assertions of one
label, CBOR outside the strict subset — raises `Uncertain`.

Even a certain read only settles a prohibition (`rights.c2pa_findings`): c2pa-python
refuses manifests for reasons only a full parse sees (a claim field of the wrong type or
version, a certificate that does not parse), and refusing is a prohibition too, so an
`allowed`, `constrained` or absent answer here could be laxer than c2pa's; those stores
are read by c2pa-python exactly as before. The claim is not read: a prohibition the store
holds is honoured whether or not the claim lists it (c2pa shows only the listed ones).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from prx_assets.stages.ingest import cbor

TRAINING_MINING_LABELS = ("c2pa.training-mining", "cawg.training-mining")

# JUMBF description box content types: 4 characters, then the ISO suffix.
_ISO_SUFFIX = bytes.fromhex("00110010800000aa00389b71")
STORE, MANIFEST, UPDATE_MANIFEST = (t + _ISO_SUFFIX for t in (b"c2pa", b"c2ma", b"c2um"))
ASSERTIONS = b"c2as" + _ISO_SUFFIX
CBOR_CONTENT = b"cbor" + _ISO_SUFFIX
# A manifest's parts: assertion store, claim, signature, credential store, databoxes.
_MANIFEST_PARTS = {t + _ISO_SUFFIX for t in (b"c2as", b"c2cl", b"c2cs", b"c2vc", b"c2db")}
_JPEG_XT_HEADER = 8  # CI "JP", En (box instance), Z (packet sequence)


class Uncertain(Exception):
    """The direct read cannot say with certainty what the store holds."""


def jpeg_store(segments: Sequence[bytes | memoryview]) -> bytes:
    """The store from a JPEG's APP11 segments (ISO 19566-5 JPEG XT boxes): the first holds
    the box from its LBox on; each next one repeats LBox and TBox, then continues it."""
    first = segments[0]
    if (len(first) < _JPEG_XT_HEADER + 28 or first[24:28] != b"c2pa"
            or int.from_bytes(first[4:8], "big") != 1):
        raise Uncertain("the first APP11 segment does not start a C2PA store")
    instance, head = first[2:4], first[8:16]
    parts = [first[_JPEG_XT_HEADER:]]
    for number, segment in enumerate(segments[1:], start=2):
        if (segment[2:4] != instance or int.from_bytes(segment[4:8], "big") != number
                or segment[8:16] != head):
            raise Uncertain("APP11 segments out of sequence or beside other JUMBF")
        parts.append(segment[16:])
    return b"".join(parts)


def single_store(chunks: Sequence[bytes | memoryview]) -> bytes:
    """The store from a PNG `caBX` or WebP `C2PA` chunk: exactly one (c2pa refuses two)."""
    if len(chunks) != 1:
        raise Uncertain(f"{len(chunks)} manifest store chunks")
    return bytes(chunks[0])


def training_mining_store(store: bytes) -> dict:
    """{"manifests": {label: {"assertions": [{"label", "data"}]}}} with each manifest's
    training-mining assertions, as c2pa's JSON has them."""
    boxes = _boxes(store, 0, len(store))
    if len(boxes) != 1:
        raise Uncertain(f"{len(boxes)} boxes where one manifest store belongs")
    label, children = _superbox(store, *boxes[0], STORE)
    if label != "c2pa" or not children:
        raise Uncertain("not a C2PA manifest store")
    manifests = {}
    for child_start, child_end in children:
        manifest_label, assertions = _manifest(store, child_start, child_end)
        if manifest_label in manifests:
            raise Uncertain(f"manifest {manifest_label} twice")
        manifests[manifest_label] = {"assertions": assertions}
    return {"manifests": manifests}


def _manifest(store: bytes, start: int, end: int) -> tuple[str, list[dict]]:
    """A manifest's label and training-mining assertions: its parts must be the known ones,
    with one assertion store."""
    boxes = _boxes(store, start, end)
    manifest_type, label = _description(store, boxes)
    if manifest_type not in (MANIFEST, UPDATE_MANIFEST) or not label:
        raise Uncertain("a store child that is not a manifest")
    assertion_stores = []
    for kind, box_start, box_end in boxes[1:]:
        if kind != b"jumb":
            raise Uncertain(f"a {kind!r} box in a manifest")
        content_type, _ = _description(store, _boxes(store, box_start, box_end))
        if content_type not in _MANIFEST_PARTS:
            raise Uncertain("an unknown part in a manifest")
        if content_type == ASSERTIONS:
            assertion_stores.append((box_start, box_end))
    if len(assertion_stores) != 1:
        raise Uncertain(f"a manifest with {len(assertion_stores)} assertion stores")
    return label, _training_mining(store, *assertion_stores[0])


def _training_mining(store: bytes, start: int, end: int) -> list[dict]:
    """The training-mining assertions of an assertion store (CBOR, JSON-like maps)."""
    _, children = _superbox(store, b"jumb", start, end, ASSERTIONS)
    labels, found = set(), []
    for child_start, child_end in children:
        content_type, label = _description(store, _boxes(store, child_start, child_end))
        if label is None or label in labels:
            raise Uncertain("an assertion without a label, or one label twice")
        labels.add(label)
        if label.startswith(TRAINING_MINING_LABELS):
            if content_type != CBOR_CONTENT:
                raise Uncertain(f"{label} is not a CBOR assertion")
            data = _cbor_content(store, child_start, child_end)
            if not isinstance(data, dict) or not _json_like(data):
                raise Uncertain(f"{label} is not a JSON-like map")
            found.append({"label": label, "data": data})
    return found


def _json_like(value: object) -> bool:
    """What c2pa's JSON would show the same: maps with text keys, lists, text, numbers."""
    if isinstance(value, dict):
        return all(isinstance(k, str) and _json_like(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_json_like(v) for v in value)
    return value is None or isinstance(value, (str, int, float))  # bool is an int


# ------------------------------------------------------------------ boxes

_BOX_HEADER = struct.Struct(">I4s")


def _boxes(data: bytes, pos: int, end: int) -> list[tuple[bytes, int, int]]:
    """(type, payload start, payload end) of each box filling data[pos:end] exactly."""
    boxes = []
    unpack = _BOX_HEADER.unpack_from
    while pos < end:
        if pos + 8 > end:
            raise Uncertain("a box header past its parent's end")
        length, kind = unpack(data, pos)
        if length < 8 or pos + length > end:  # 0 (to the end) and 1 (XLBox): not written
            raise Uncertain(f"a {kind!r} box of length {length} at {pos}")
        boxes.append((kind, pos + 8, pos + length))
        pos += length
    return boxes


def _superbox(data: bytes, kind: bytes, start: int, end: int,
              content_type: bytes) -> tuple[str | None, list[tuple[int, int]]]:
    """A `jumb` superbox of `content_type`: its label and its child superboxes."""
    if kind != b"jumb":
        raise Uncertain(f"a {kind!r} box where a superbox belongs")
    boxes = _boxes(data, start, end)
    found_type, label = _description(data, boxes)
    if found_type != content_type:
        raise Uncertain("a superbox of an unexpected content type")
    children = []
    for child_kind, child_start, child_end in boxes[1:]:
        if child_kind != b"jumb":
            raise Uncertain(f"a {child_kind!r} box among superboxes")
        children.append((child_start, child_end))
    return label, children


def _description(data: bytes, boxes: list[tuple[bytes, int, int]]) -> tuple[bytes, str | None]:
    """The first box's content type and label: it must be the `jumd` description box
    (type UUID, toggles, then the label, NUL-terminated, when toggle 0x02 is set)."""
    if not boxes or boxes[0][0] != b"jumd" or boxes[0][2] - boxes[0][1] < 17:
        raise Uncertain("a superbox without its description box")
    _, start, end = boxes[0]
    content_type, toggles = data[start:start + 16], data[start + 16]
    if not toggles & 0x02:
        return content_type, None
    nul = data.find(b"\x00", start + 17, end)
    if nul < 0:
        raise Uncertain("a label without its NUL")
    try:
        return content_type, data[start + 17:nul].decode("utf-8")
    except UnicodeDecodeError:
        raise Uncertain("a label that is not UTF-8") from None


def _cbor_content(data: bytes, start: int, end: int) -> object:
    """The one `cbor` content box of a superbox, decoded."""
    boxes = _boxes(data, start, end)
    _description(data, boxes)
    if len(boxes) != 2 or boxes[1][0] != b"cbor":
        raise Uncertain("a superbox without exactly one cbor content box")
    _, box_start, box_end = boxes[1]
    try:
        return cbor.loads(data[box_start:box_end])
    except cbor.CborError as exc:
        raise Uncertain(f"CBOR: {exc}") from None
