"""The strict CBOR decoder: RFC 8949 Appendix A examples it reads, and everything outside
its subset refused (the direct C2PA read then falls back to c2pa-python)."""

from __future__ import annotations

import math

import pytest

from prx_assets.stages.ingest.cbor import MAX_DEPTH, CborError, loads


@pytest.mark.parametrize(("hex_", "value"), [
    ("00", 0), ("17", 23), ("1818", 24), ("1903e8", 1000), ("1a000f4240", 1000000),
    ("1b000000e8d4a51000", 1000000000000), ("20", -1), ("3863", -100),
    ("f4", False), ("f5", True), ("f6", None), ("f93c00", 1.0), ("fa47c35000", 100000.0),
    ("fb3ff199999999999a", 1.1), ("40", b""), ("4401020304", b"\x01\x02\x03\x04"),
    ("60", ""), ("6449455446", "IETF"), ("62c3bc", "\u00fc"), ("80", []),
    ("8301820203820405", [1, [2, 3], [4, 5]]), ("a0", {}), ("a201020304", {1: 2, 3: 4}),
    ("a26161016162820203", {"a": 1, "b": [2, 3]}),
    ("a163757365" "67616c6c6f776564", {"use": "allowed"}),
])
def test_rfc_8949_examples(hex_, value):
    assert loads(bytes.fromhex(hex_)) == value


def test_a_half_precision_infinity():
    assert math.isinf(loads(bytes.fromhex("f97c00")))


@pytest.mark.parametrize(("hex_", "why"), [
    ("9fff", "additional information 31"),  # indefinite-length array
    ("5f42010243030405ff", "additional information 31"),  # indefinite byte string
    ("1c", "additional information 28"),
    ("c074323031332d30332d32315432303a30343a30305a", "tag 0"),
    ("a2616101616102", "duplicate map key"),
    ("a1f401", "map key of type bool"),
    ("0000", "1 bytes after the item"),
    ("62c3", "runs past the end"),
    ("6280ff", "not UTF-8"),
    ("8301820203", "truncated"),
    ("f7", "simple value 23"),  # undefined
    ("9bffffffffffffffff", "runs past the end"),
    ("", "truncated"),
])
def test_anything_outside_the_subset_is_refused(hex_, why):
    with pytest.raises(CborError, match=why):
        loads(bytes.fromhex(hex_))


def test_nesting_is_bounded():
    with pytest.raises(CborError, match="nested too deep"):
        loads(b"\x81" * (MAX_DEPTH + 1) + b"\x00")
    assert loads(b"\x81" * MAX_DEPTH + b"\x00") is not None
