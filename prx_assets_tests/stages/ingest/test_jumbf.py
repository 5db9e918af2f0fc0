"""The direct C2PA read (JUMBF boxes, strict CBOR) against c2pa-python on manifests signed
by c2pa-python, and its fall-backs: a layout it is not sure of goes to c2pa-python, and only
a prohibition it reads is final."""

from __future__ import annotations

import struct

import pytest

from prx_assets.stages.ingest import jumbf, rights
from prx_assets.stages.ingest.markers import find_markers
from prx_assets.stages.ingest.rights import PROHIBITED, read_reservation
from prx_assets.testing import rights_fixtures as rf

pytest.importorskip("c2pa")

USES = {"notAllowed": {"ai_generative_training": "notAllowed", "ai_inference": "allowed"},
        "allowed": {"ai_training": "allowed", "data_mining": "allowed"},
        "constrained": {"ai_training": "constrained"},
        "absent": None}


def _direct(data: bytes) -> list[rights.Finding]:
    markers = find_markers(data)
    return rights.training_mining_findings(rights.direct_store(markers.jumbf, markers.mime))


def _sign(fmt: str, uses: str, label: str = "cawg.training-mining", **kw) -> bytes:
    return rf.sign_training_mining(rf.photo(fmt, 32), rf.FORMATS[fmt][2], USES[uses], label,
                                   **kw)


@pytest.fixture(scope="module")
def manifests() -> dict[tuple[str, str, str], bytes]:
    """Every use (and none) in every format, under both labels across them."""
    return {(fmt, uses, label): _sign(fmt, uses, label)
            for fmt in rf.FORMATS for uses in USES
            for label in (("c2pa.training-mining",) if fmt == "png"
                          else ("cawg.training-mining",))}


def test_the_direct_read_agrees_with_c2pa_python_on_every_manifest(manifests):
    for case, data in manifests.items():
        slow = rights._c2pa_python_findings(data, rf.FORMATS[case[0]][2])
        assert _direct(data) == slow, case
        assert bool(slow) == (case[1] != "absent"), case


def test_it_reads_every_manifest_of_the_store(manifests):
    parent = manifests["jpeg", "notAllowed", "cawg.training-mining"]
    child = _sign("jpeg", "allowed", ingredient=parent)
    assert len(rights.direct_store(*_parts(child))["manifests"]) == 2
    # c2pa-python lists the manifests in no fixed order.
    assert sorted(map(str, _direct(child))) == sorted(
        map(str, rights._c2pa_python_findings(child, "image/jpeg")))
    assert read_reservation(child).status == PROHIBITED


def _parts(data: bytes) -> tuple[tuple[bytes, ...], str | None]:
    markers = find_markers(data)
    return markers.jumbf, markers.mime


def test_a_direct_prohibition_is_final_without_c2pa_python(manifests, monkeypatch):
    def refuse(*_):
        raise AssertionError("c2pa-python read a store the direct read settled")

    monkeypatch.setattr(rights, "_c2pa_python_findings", refuse)
    for (fmt, uses, _), data in manifests.items():
        if uses == "notAllowed":
            assert read_reservation(data).status == PROHIBITED, fmt


def test_any_other_answer_goes_to_c2pa_python(manifests, monkeypatch):
    read = []
    monkeypatch.setattr(rights, "_c2pa_python_findings",
                        lambda data, mime: read.append(mime) or [])
    for (_, uses, _), data in manifests.items():
        if uses != "notAllowed":
            read_reservation(data)
    assert len(read) == 3 * 3


def _replace_once(data: bytes, old: bytes, new: bytes) -> bytes:
    assert len(old) == len(new) and data.count(old) == 1
    return data.replace(old, new)


def test_a_claim_c2pa_python_refuses_is_reserved_even_when_the_assertion_allows():
    # The claim still decodes (the direct read is sure of it) but lacks a field c2pa needs.
    data = _replace_once(_sign("jpeg", "allowed"), b"claim_generator_info",
                         b"claim_generator_infx")
    assert rights.training_mining_findings(rights.direct_store(*_parts(data))) != []
    reservation = read_reservation(data)
    assert reservation.status == PROHIBITED
    assert "unreadable manifest" in reservation.signal


def test_a_manifest_c2pa_python_leaves_out_is_reserved():
    # An assertion whose CBOR does not decode: c2pa raises nothing, it drops the manifest
    # and names it among the validation failures only.
    data = _replace_once(_sign("png", "allowed"), b"\xa1gactions", b"\xffgactions")
    reservation = read_reservation(data)
    assert reservation.status == PROHIBITED
    assert "unreadable manifest (assertion" in reservation.signal


@pytest.mark.parametrize("damage", ["box length", "segments out of order", "two stores",
                                    "unknown manifest part", "indefinite-length CBOR"])
def test_a_layout_the_direct_read_is_not_sure_of_falls_back(manifests, damage):
    data = manifests["jpeg", "notAllowed", "cawg.training-mining"]
    parts, mime = _parts(data)
    if damage == "box length":  # the claim's description box runs past its superbox
        start = data.index(b"c2pa.claim.v2\x00") - 1 - 16 - 8  # toggles, type, header
        assert data[start + 4:start + 8] == b"jumd"
        data = data[:start] + struct.pack(">I", 1 << 30) + data[start + 4:]
        parts = find_markers(data).jumbf
    elif damage == "segments out of order":
        parts = (parts[1], parts[0]) if len(parts) > 1 else parts + parts
    elif damage == "two stores":
        parts, mime = parts[:1] * 2, "image/png"
    elif damage == "unknown manifest part":  # the claim's content type, c2cl, unknown
        data = _replace_once(data, b"c2cl" + jumbf._ISO_SUFFIX, b"c2cx" + jumbf._ISO_SUFFIX)
        parts = find_markers(data).jumbf
    else:
        data = _replace_once(data, b"\xa1gentries", b"\xbfgentries")
        parts = find_markers(data).jumbf
    with pytest.raises(jumbf.Uncertain):
        rights.direct_store(parts, mime or "image/jpeg")

