"""Reservations read from real metadata: XMP written by exiftool, C2PA signed by c2pa-python,
sidecar headers and the domain list, and the damaged variants (fail closed)."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest

from prx_assets.stages.ingest import rights
from prx_assets.stages.ingest.markers import find_markers
from prx_assets.stages.ingest.rights import (
    CONSTRAINED,
    DATA_MINING,
    NONE,
    PLUS_NS,
    PLUS_VOCAB,
    PROHIBITED,
    RDF_NS,
    Finding,
    packet_body,
    parse_domain_list,
    parsed_xmp_findings,
    plain_data_mining,
    plain_term,
    read_reservation,
    sidecar_findings,
    xmp_findings,
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
        # What exiftool writes takes the plain path, and the full parse agrees with it.
        body = packet_body(find_markers(data).xmp or b"")
        assert plain_data_mining(body) == fixture.value, fixture
        assert xmp_findings(body) == parsed_xmp_findings(body), fixture


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
@pytest.mark.parametrize("form", rf.FORMS)
def test_a_prohibition_said_plainly_is_taken_without_the_well_formedness_check(
        xmp_images, monkeypatch, form):
    # The packet is prohibited whether or not it is well-formed: expat is not asked, and a
    # malformed packet's finding is its term (the error it would have had is not recorded).
    def no_parse(body: bytes) -> bool:
        raise AssertionError("the well-formedness check ran")

    monkeypatch.setattr(rights, "_well_formed", no_parse)
    good = next(f for f in xmp_images if f.fmt == "jpeg" and f.form == form
                and f.value == "DMI-PROHIBITED-AIMLTRAINING")
    for data in (good.path.read_bytes(), rf.malformed_xmp(good.path.read_bytes())):
        rights.forget_findings()
        reservation = read_reservation(data)
        assert (reservation.status, reservation.signal) == (
            PROHIBITED, "xmp=plus:DataMining=DMI-PROHIBITED-AIMLTRAINING")


@needs_exiftool
def test_an_allowing_or_constraining_term_still_needs_a_well_formed_packet(xmp_images):
    for value in ("DMI-ALLOWED", "DMI-UNSPECIFIED", "DMI-PROHIBITED-SEECONSTRAINT"):
        good = next(f for f in xmp_images if f.fmt == "png" and f.value == value)
        rights.forget_findings()
        reservation = read_reservation(rf.malformed_xmp(good.path.read_bytes()))
        assert reservation.status == PROHIBITED, value
        assert "unreadable packet" in reservation.signal, value


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


# Packets as exiftool and others write them (the plain forms, and forms only the full parse
# reads), for the differential test of the plain path against the full parse.
_WRAP = ("<?xpacket begin='\ufeff' id='W5M0MpCehiHzreSzNTczkc9d'?>\n"
         "<x:xmpmeta xmlns:x='adobe:ns:meta/' x:xmptk='Image::ExifTool 12.57'>\n"
         f"<rdf:RDF xmlns:rdf='{RDF_NS}'>\n{{}}\n</rdf:RDF>\n</x:xmpmeta>\n"
         + " " * 40 + "\n<?xpacket end='w'?>")
_DESCRIPTION = f" <rdf:Description rdf:about=''\n  xmlns:plus='{PLUS_NS}'{{}}"
SEED_PACKETS = [_WRAP.format(body).encode() for body in [
    _DESCRIPTION.format(f">\n  <plus:DataMining>{PLUS_VOCAB}DMI-ALLOWED</plus:DataMining>\n"
                        " </rdf:Description>"),
    _DESCRIPTION.format(f"\n  plus:DataMining='{PLUS_VOCAB}DMI-PROHIBITED-SEECONSTRAINT'/>"),
    _DESCRIPTION.format(' plus:DataMining="DMI-UNSPECIFIED" xmlns:dc="http://purl.org/dc/'
                        'elements/1.1/">\n  <dc:creator><rdf:Seq><rdf:li>A. B.</rdf:li>'
                        '</rdf:Seq></dc:creator>\n </rdf:Description>'),
    _DESCRIPTION.format(f"><plus:DataMining rdf:resource='{PLUS_VOCAB}DMI-ALLOWED'/>"
                        "</rdf:Description>"),
    _DESCRIPTION.format(f"><plus:DataMining><rdf:Alt><rdf:li xml:lang='x-default'>"
                        f"{PLUS_VOCAB}DMI-ALLOWED</rdf:li></rdf:Alt></plus:DataMining>"
                        "</rdf:Description>"),
    _DESCRIPTION.format("><!-- <plus:DataMining>DMI-PROHIBITED</plus:DataMining> -->"
                        "<plus:DataMining>DMI-ALLOWED</plus:DataMining></rdf:Description>"),
    _DESCRIPTION.format("><plus:DataMining><![CDATA[DMI-ALLOWED]]></plus:DataMining>"
                        "</rdf:Description>"),
    _DESCRIPTION.format(" plus:DataMining='DMI-PROHIBITED'><plus:DataMining>DMI-ALLOWED"
                        "</plus:DataMining></rdf:Description>"),
    _DESCRIPTION.format("><!-- <plus:DataMining>DMI-ALLOWED</plus:DataMining> -->"
                        "</rdf:Description>"),
    _DESCRIPTION.format("/><?pi <rdf:Description plus:DataMining='DMI-ALLOWED'/>?>"),
    _DESCRIPTION.format(" xmlns:dc='http://purl.org/dc/elements/1.1/'><dc:title><![CDATA["
                        "<rdf:Description plus:DataMining='DMI-ALLOWED'/>]]></dc:title>"
                        "</rdf:Description>"),
    f" <rdf:Description xmlns:p='{PLUS_NS}' p:DataMining='DMI-ALLOWED'/>\n"
    f" <rdf:Description xmlns:plus='{PLUS_NS}' plus:DataMining='DMI-PROHIBITED'/>",
]]
# Seeds that prohibit in the plain forms: their mutants take the shortcut that skips expat.
PROHIBITING_SEEDS = [_WRAP.format(body).encode() for body in [
    _DESCRIPTION.format(f">\n  <plus:DataMining>{PLUS_VOCAB}DMI-PROHIBITED-AIMLTRAINING"
                        "</plus:DataMining>\n </rdf:Description>"),
    _DESCRIPTION.format("\n  plus:DataMining='DMI-PROHIBITED'/>"),
]]
# Pieces a mutation inserts: XML's significant characters and the tokens the plain path
# keys on, so that mutants hit its every guard.
_PIECES = [b"<", b">", b"/", b"'", b'"', b"=", b"&", b"&amp;", b"&x;", b"!", b"?", b" ", b"\n",
           b"-", b":", b"]]>", b"<!--", b"-->", b"<![CDATA[", b"<?pi ?>", b"\xff", b"\x01",
           b"plus", b"rdf", b"DataMining", b"plus:DataMining", b"<plus:DataMining>",
           b"</plus:DataMining>", b"xmlns:plus", f"xmlns:plus='{PLUS_NS}'".encode(),
           b"xmlns:plus='http://example.org/'", b"xmlns:rdf='http://example.org/'",
           f" plus:DataMining='{PLUS_VOCAB}DMI-ALLOWED'".encode(), b"DMI-ALLOWED",
           b"<rdf:Description>", b"</rdf:Description>", b"<rdf:Description ", b" x='1'",
           b" rdf:about=''", b"xmlns='" + PLUS_NS.encode() + b"'",
           # Namespace errors a parse without namespace processing would let through.
           b"<u:x/>", b" u:y='1'", b" plus:x='1' p2:x='2' xmlns:p2='" + PLUS_NS.encode() + b"'",
           b"xmlns:plus=''", b"</rdf:Description><rdf:Description>"]


def _mutant(packet: bytes, rng: random.Random) -> bytes:
    """`packet` with one or two random edits (one mostly): a piece inserted or swapped in,
    a span deleted or doubled."""
    for _ in range(rng.choice((1, 1, 1, 2))):
        at = rng.randrange(len(packet))
        span = rng.randint(1, 12)
        edit = rng.randrange(4)
        if edit == 0:
            packet = packet[:at] + rng.choice(_PIECES) + packet[at:]
        elif edit == 1:
            packet = packet[:at] + rng.choice(_PIECES) + packet[at + span:]
        elif edit == 2:
            packet = packet[:at] + packet[at + span:]
        else:
            packet = packet[:at + span] + packet[at:]
    return packet


def test_the_plain_path_agrees_with_the_full_parse_on_every_seed():
    plain = [plain_data_mining(packet_body(p)) for p in SEED_PACKETS]
    assert plain[:3] == ["DMI-ALLOWED", "DMI-PROHIBITED-SEECONSTRAINT", "DMI-UNSPECIFIED"]
    assert plain[3:] == [None] * (len(SEED_PACKETS) - 3)  # the full parse reads these
    for packet in SEED_PACKETS:
        assert xmp_findings(packet) == parsed_xmp_findings(packet_body(packet))


def test_a_packet_seen_again_reads_as_the_first_time():
    # Findings are kept per packet: the caller's list is its own, a malformed packet stays
    # reserved, and a packet past the kept size is read the same.
    packet = SEED_PACKETS[1]
    xmp_findings(packet).clear()
    assert xmp_findings(packet) == parsed_xmp_findings(packet_body(packet)) != []
    broken = packet.replace(b"</rdf:RDF>", b"</rdf:RDX>")
    assert xmp_findings(broken) == xmp_findings(broken) == parsed_xmp_findings(
        packet_body(broken))
    padded = packet.replace(b"<rdf:Description", b" " * (20 << 10) + b"<rdf:Description")
    assert xmp_findings(padded) == parsed_xmp_findings(packet_body(padded))


# Well-formed XML whose namespaces are wrong (the full parse refuses each): an unbound
# prefix elsewhere in the packet, plus bound on a sibling only, one attribute twice once
# its prefixes are expanded, a prefix undeclared. Expat without namespace processing
# accepts all four; the plain path must not answer for any.
_ALLOWED = "<plus:DataMining>DMI-ALLOWED</plus:DataMining>"
NAMESPACE_ERRORS = [_WRAP.format(body).encode() for body in [
    _DESCRIPTION.format(f"><dc:title>a</dc:title>{_ALLOWED}</rdf:Description>"),
    f" <rdf:Description xmlns:plus='{PLUS_NS}'/>\n"
    f" <rdf:Description>{_ALLOWED}</rdf:Description>",
    _DESCRIPTION.format(f" xmlns:p='{PLUS_NS}' plus:x='1' p:x='2'>{_ALLOWED}"
                        "</rdf:Description>"),
    _DESCRIPTION.format(f"><rdf:li xmlns:plus=''/>{_ALLOWED}</rdf:Description>"),
]]


def test_a_namespace_error_is_reserved_as_the_full_parse_reserves_it():
    for packet in NAMESPACE_ERRORS:
        body = packet_body(packet)
        parsed = parsed_xmp_findings(body)
        assert "unreadable packet" in parsed[0].value, packet
        assert plain_data_mining(body) is None, packet
        assert xmp_findings(packet) == parsed


def test_the_plain_path_is_never_laxer_than_the_full_parse_on_mutants():
    """Differential: 2,000 seeded mutants of the seed packets. Wherever the plain path
    answers, the full parse gives the same finding (a malformed mutant gets its error);
    a prohibition read plainly, taken without the well-formedness check, has the status
    the full parse gives (its finding on a well-formed mutant, its error on another)."""
    rng = random.Random(46)
    seeds = SEED_PACKETS + PROHIBITING_SEEDS
    answered, malformed, unchecked = 0, 0, 0
    for n in range(2000):
        packet = _mutant(seeds[n % len(seeds)], rng)
        body = packet_body(packet)
        parsed = parsed_xmp_findings(body)
        unreadable = bool(parsed) and "unreadable packet" in parsed[0].value
        malformed += unreadable
        term = plain_data_mining(body)
        if term is not None:
            answered += 1
            assert parsed == [Finding("xmp", f"plus:DataMining={term}", DATA_MINING[term])], \
                packet
        if b"DataMining" not in packet:
            continue
        said = plain_term(body)
        if said is not None and DATA_MINING[said] == PROHIBITED:
            unchecked += unreadable
            assert xmp_findings(packet) == [
                Finding("xmp", f"plus:DataMining={said}", PROHIBITED)], packet
            assert parsed == xmp_findings(packet) or unreadable, packet
        else:
            assert xmp_findings(packet) == parsed, packet
    # The mutants reach every side: the plain path answers, the parser refuses, and
    # malformed packets take the unchecked prohibition.
    assert answered > 150 and malformed > 400 and unchecked > 20, (answered, malformed,
                                                                    unchecked)


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
