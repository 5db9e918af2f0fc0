"""Reservations read from real metadata: XMP written by exiftool, C2PA signed by c2pa-python,
sidecar headers and the domain list, and the damaged variants (fail closed)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from prx_assets.stages.ingest.rights import (
    CONSTRAINED,
    DATA_MINING,
    NONE,
    PROHIBITED,
    find_markers,
    parse_domain_list,
    read_reservation,
    sidecar_findings,
)
from prx_assets.testing import rights_fixtures as rf

needs_exiftool = pytest.mark.skipif(not rf.exiftool_available(),
                                     reason="exiftool (libimage-exiftool-perl) not installed")


@pytest.fixture(scope="module")
def xmp_images(tmp_path_factory: pytest.TempPathFactory) -> list[rf.XmpFixture]:
    """Every PLUS term in every format and form: one exiftool process."""
    cases = list(itertools.product(rf.FORMATS, rf.FORMS, DATA_MINING))
    return rf.write_data_mining(tmp_path_factory.mktemp("xmp"), cases, size=48)


@needs_exiftool
def test_every_data_mining_value_in_every_format_and_form(xmp_images):
    assert len(xmp_images) == 3 * 2 * len(DATA_MINING)
    for fixture in xmp_images:
        data = fixture.path.read_bytes()
        reservation = read_reservation(data)
        assert reservation.status == DATA_MINING[fixture.value], fixture
        if reservation.status != NONE:
            assert reservation.signal == f"xmp=plus:DataMining={fixture.value}", fixture


@needs_exiftool
def test_exiftool_writes_the_form_asked(xmp_images):
    by_form = {f.form: find_markers(f.path.read_bytes()).xmp for f in xmp_images
               if f.fmt == "jpeg" and f.value == "DMI-PROHIBITED"}
    assert b"<plus:DataMining>" in by_form["element"]
    assert b"plus:DataMining='" in by_form["attribute"]


def test_an_image_without_metadata_has_no_markers_and_no_reservation():
    for fmt in rf.FORMATS:
        data = rf.photo(fmt, 48)
        assert find_markers(data).xmp is None and not find_markers(data).jumbf
        assert read_reservation(data).status == NONE
        assert read_reservation(data).signal is None


@needs_exiftool
def test_a_malformed_packet_is_reserved_with_its_error(xmp_images):
    good = next(f for f in xmp_images if f.fmt == "jpeg" and f.value == "DMI-ALLOWED")
    reservation = read_reservation(rf.malformed_xmp(good.path.read_bytes()))
    assert reservation.status == PROHIBITED
    assert "unreadable packet" in reservation.signal


@needs_exiftool
def test_a_packet_without_data_mining_is_no_signal(tmp_path: Path):
    # exiftool writing another property: an XMP packet, but nothing said about mining.
    path = tmp_path / "a.jpg"
    path.write_bytes(rf.photo("jpeg", 48))
    import subprocess

    subprocess.run(["exiftool", "-q", "-overwrite_original", "-XMP-dc:Creator=Someone",
                    str(path)], check=True)
    data = path.read_bytes()
    assert find_markers(data).xmp is not None
    assert read_reservation(data).status == NONE


@pytest.fixture(scope="module")
def signed_jpeg() -> bytes:
    pytest.importorskip("c2pa")
    return rf.sign_training_mining(rf.photo("jpeg", 64), "image/jpeg", {
        "ai_generative_training": "notAllowed", "ai_training": "constrained",
        "ai_inference": "allowed", "data_mining": "allowed"})


def test_a_c2pa_do_not_train_manifest_is_a_prohibition(signed_jpeg):
    assert find_markers(signed_jpeg).jumbf
    reservation = read_reservation(signed_jpeg)
    assert reservation.status == PROHIBITED
    assert reservation.signal == ("c2pa=cawg.ai_generative_training=notAllowed; "
                                  "c2pa=cawg.ai_training=constrained")


@pytest.mark.parametrize(("uses", "label", "status"), [
    ({"ai_training": "allowed", "ai_generative_training": "allowed"}, "c2pa.training-mining",
     NONE),
    ({"ai_training": "constrained"}, "c2pa.training-mining", CONSTRAINED),
    ({"ai_inference": "notAllowed"}, "cawg.training-mining", NONE),  # not about training
    ({"data_mining": "notAllowed"}, "cawg.training-mining", PROHIBITED),
])
def test_c2pa_uses_and_both_labels(uses, label, status):
    pytest.importorskip("c2pa")
    fmt = "png" if label.startswith("c2pa") else "jpeg"
    signed = rf.sign_training_mining(rf.photo(fmt, 48), rf.FORMATS[fmt][2], uses, label)
    assert find_markers(signed).jumbf
    assert read_reservation(signed).status == status


def test_a_corrupt_manifest_is_reserved_with_its_error(signed_jpeg):
    reservation = read_reservation(rf.corrupt_manifest(signed_jpeg))
    assert reservation.status == PROHIBITED
    assert "unreadable manifest" in reservation.signal


def test_an_allowed_signal_does_not_lift_another_prohibition():
    data = rf.photo("jpeg", 48)
    reservation = read_reservation(data, {"X-Robots-Tag": "noimageai", "tdm-reservation": 0})
    assert reservation.status == PROHIBITED


@pytest.mark.parametrize(("sidecar", "status", "signal"), [
    ({"X-Robots-Tag": "noai, noimageai"}, PROHIBITED, "x-robots-tag=noai; x-robots-tag=noimageai"),
    ({"x_robots_tag": "otherbot: noimageai"}, PROHIBITED, "x-robots-tag=noimageai"),
    ({"x-robots-tag": "noindex, nofollow"}, NONE, None),
    ({"tdm-reservation": 1}, PROHIBITED, "tdmrep=tdm-reservation=1"),
    ({"tdm_reservation": "1", "tdm_policy": "https://a.example/policy.json"}, CONSTRAINED,
     "tdmrep=tdm-reservation=1 tdm-policy=https://a.example/policy.json"),
    ({"tdm-reservation": 0}, NONE, None),
    ({"tdm-reservation": "yes"}, PROHIBITED, "tdmrep=tdm-reservation=yes (unreadable)"),
    ({"caption": "a cat"}, NONE, None),
])
def test_sidecar_headers(sidecar, status, signal):
    reservation = read_reservation(None, sidecar)
    assert (reservation.status, reservation.signal) == (status, signal)
    assert bool(sidecar_findings(sidecar)) == (signal is not None)


def test_domain_list_covers_subdomains_and_prefixes():
    domains = parse_domain_list("# reserved\nExample.com\nhttps://photos.example.org/private/\n")
    assert read_reservation(None, url="https://cdn.example.com/a.jpg", domains=domains).signal \
        == "domain=example.com"
    assert read_reservation(None, url="https://example.com/a.jpg", domains=domains).status \
        == PROHIBITED
    assert read_reservation(None, url="https://notexample.com/a.jpg",
                            domains=domains).status == NONE
    assert read_reservation(None, url="https://photos.example.org/private/1.jpg",
                            domains=domains).status == PROHIBITED
    assert read_reservation(None, url="https://photos.example.org/public/1.jpg",
                            domains=domains).status == NONE
