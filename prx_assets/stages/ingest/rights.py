"""Machine-readable training reservations, read at ingest from the bytes already in hand
and the sample's sidecar (its WebDataset `.json`, or its Parquet/Lance columns).

Signals (docs/rights.md has each value and what the pipeline does with it):

- XMP `plus:DataMining` (IPTC/PLUS), as an element, an `rdf:resource` or an attribute of
  `rdf:Description`, in a JPEG APP1 segment, a PNG `iTXt` chunk (`XML:com.adobe.xmp`) or
  WebP's `XMP ` chunk;
- C2PA manifests (JPEG APP11, PNG `caBX`, WebP `C2PA`) with a `c2pa.training-mining` or
  `cawg.training-mining` assertion, read from the JUMBF boxes directly (`jumbf.py`), or with
  c2pa-python where the direct read is not certain;
- the sidecar's `X-Robots-Tag` (`noai`, `noimageai`) and TDMRep `tdm-reservation`;
- a list of domains or URL prefixes (`DomainList`, applied to the row's `url`).

Cost: a file without XMP or JUMBF pays a walk of its container's segment headers only
(`find_markers`); an XMP packet is read only when it names `DataMining`, and parsed whole
only when it does not say it in one of the plain forms (`xmp_findings`).

Fail closed: a signal that is present but cannot be read (a malformed packet, a corrupt
manifest, c2pa-python missing) is a prohibition, with the error in the signal text. One
exception to the text, not the status: a packet that says a prohibiting term in a plain
form is not checked for well-formedness, so a malformed one is recorded with its term.
"""

from __future__ import annotations

import functools
import io
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit
from xml.etree import ElementTree
from xml.parsers import expat

from prx_assets.stages.ingest import jumbf
from prx_assets.stages.ingest.jumbf import TRAINING_MINING_LABELS
from prx_assets.stages.ingest.markers import find_markers

NONE, CONSTRAINED, PROHIBITED = "none", "constrained", "prohibited"
_RANK = {NONE: 0, CONSTRAINED: 1, PROHIBITED: 2}

PLUS_VOCAB = "http://ns.useplus.org/ldf/vocab/"
PLUS_NS = "http://ns.useplus.org/ldf/xmp/1.0/"
RDF_NS = "http://www.w3.org/1999/02/22-rdf-syntax-ns#"
# plus:DataMining values (IPTC Photo Metadata 2023.1) -> what they mean for training.
DATA_MINING = {
    "DMI-UNSPECIFIED": NONE,
    "DMI-ALLOWED": NONE,
    "DMI-PROHIBITED-AIMLTRAINING": PROHIBITED,
    "DMI-PROHIBITED-GENAIMLTRAINING": PROHIBITED,
    # Mining is allowed for search indexing only: training is not.
    "DMI-PROHIBITED-EXCEPTSEARCHENGINEINDEXING": PROHIBITED,
    "DMI-PROHIBITED": PROHIBITED,
    # Prohibited unless the constraints (plus:OtherConstraints, an embedded or linked rights
    # expression) allow it: a curator reads them and clears the sample, or it stays out.
    "DMI-PROHIBITED-SEECONSTRAINT": CONSTRAINED,
    "DMI-PROHIBITED-SEEEMBEDDEDRIGHTSEXPR": CONSTRAINED,
    "DMI-PROHIBITED-SEELINKEDRIGHTSEXPR": CONSTRAINED,
}
# C2PA / CAWG training-and-mining entries that concern training (inference does not).
TRAINING_USES = ("ai_generative_training", "ai_training", "data_mining")
C2PA_USE = {"allowed": NONE, "notAllowed": PROHIBITED, "constrained": CONSTRAINED}
ROBOTS_RESERVED = frozenset({"noai", "noimageai"})



@dataclass(frozen=True)
class Finding:
    """What one signal said: its name (`xmp`, `c2pa`, `x-robots-tag`, `tdmrep`, `domain`),
    the value read (or the error), and what it means."""

    signal: str
    value: str
    status: str

    def __str__(self) -> str:
        return f"{self.signal}={self.value}"


# What a PLUS term says, as the plain reading finds it in most packets (built once).
_TERM_FINDINGS = {term: Finding("xmp", f"plus:DataMining={term}", status)
                  for term, status in DATA_MINING.items()}


@dataclass(frozen=True)
class Reservation:
    """A sample's reservation: the strictest status of its findings (`none` without any),
    and each finding that reserved it, for the row's `reservation_signal`."""

    findings: tuple[Finding, ...] = ()

    @property
    def status(self) -> str:
        if not self.findings:  # most samples: no signal at all
            return NONE
        if len(self.findings) == 1:  # most of the rest: one
            return self.findings[0].status
        return max((f.status for f in self.findings), key=_RANK.__getitem__, default=NONE)

    @property
    def signal(self) -> str | None:
        if not self.findings:
            return None
        if len(self.findings) == 1:  # most reserved samples: one finding
            only = self.findings[0]
            return None if only.status == NONE else str(only)
        reserving = [str(f) for f in self.findings if f.status != NONE]
        return "; ".join(reserving) or None


# What most samples have: no signal (shared, not built per sample).
NO_RESERVATION = Reservation()


def read_reservation(data: bytes | None, sidecar: Mapping[str, object] | None = None,
                     url: str | None = None, domains: DomainList | None = None) -> Reservation:
    """Every signal the bytes, the sidecar and the url carry about training on the image."""
    findings: list[Finding] = []
    if data:
        markers = find_markers(data)
        if markers.xmp is not None:
            findings += xmp_findings(markers.xmp)
        if markers.jumbf:
            findings += c2pa_findings(data, markers.mime or "image/jpeg", markers.jumbf)
    if sidecar:
        findings += sidecar_findings(sidecar)
    if url and domains:
        findings += domains.findings(url)
    return Reservation(tuple(findings)) if findings else NO_RESERVATION


# ------------------------------------------------------------------ XMP

# Packets up to this size have their findings kept (`_remembered_findings`): a batch
# stamped by one tool repeats its packet byte for byte. At most 256 x 16 KiB a process.
_REMEMBERED_BODY_BYTES = 16 << 10


def xmp_findings(packet: bytes) -> list[Finding]:
    """plus:DataMining of an XMP packet; none when the packet does not name it (no signal),
    a prohibition with the error when it does and cannot be parsed."""
    if b"DataMining" not in packet:
        return []
    body = packet_body(packet)
    if len(body) > _REMEMBERED_BODY_BYTES:
        return list(_body_findings(body))
    return list(_remembered_findings(body))


def _body_findings(body: bytes) -> tuple[Finding, ...]:
    """A packet that says it once, in the element or the attribute form, with a value from
    the vocabulary, is read plainly (`plain_term`); any other packet is parsed whole
    (ElementTree), which also gives a malformed packet its error.

    A plain term that allows or constrains is taken only once expat has checked the
    packet well-formed and every prefix bound (without building a tree): a malformed
    packet is prohibited. A plain term that prohibits is taken as it is: the packet is
    prohibited whether or not it is well-formed, so the check could change only the
    finding's text (a malformed one's would be its error), never a status; it is more
    than half of a packet's reading (docs/rights.md, Cost)."""
    term = plain_term(body)
    if term is not None:
        finding = _TERM_FINDINGS[term]
        if finding.status == PROHIBITED or _well_formed(body):
            return (finding,)
    return tuple(parsed_xmp_findings(body))


# The findings are the body's alone (the same bytes, the same findings), so a packet seen
# again costs a hash of its bytes.
_remembered_findings = functools.lru_cache(maxsize=256)(_body_findings)


def forget_findings() -> None:
    """Forget the findings kept per packet (the bench reads every packet as the first time)."""
    _remembered_findings.cache_clear()


def parsed_xmp_findings(body: bytes) -> list[Finding]:
    """plus:DataMining of the `<x:xmpmeta>` element, parsed whole: the reference reading
    `plain_data_mining` must agree with."""
    try:
        root = ElementTree.fromstring(body)
    except ElementTree.ParseError as exc:
        return [Finding("xmp", f"unreadable packet ({exc})", PROHIBITED)]
    values = list(_data_mining_values(root))
    if not values:
        return [Finding("xmp", "DataMining named but not a plus:DataMining property",
                        PROHIBITED)]
    return [_data_mining_finding(value) for value in values]


# The plain forms exiftool and Adobe's XMP toolkit write (the prefixes bound as below).
_PLUS_ELEMENT_OPEN, _PLUS_ELEMENT_CLOSE = b"<plus:DataMining>", b"</plus:DataMining>"
_PLUS_ATTRIBUTE = re.compile(
    rb"<rdf:Description(?:\s+[^\s=<>/]+\s*=\s*(?:'[^']*'|\"[^\"]*\"))*"
    rb"\s+plus:DataMining\s*=\s*(?:'([^']*)'|\"([^\"]*)\")")


def _binding(prefix: bytes, uri: str) -> tuple[bytes, bytes, bytes]:
    """`xmlns:prefix`, and its declaration binding `uri` in either quote."""
    declaration = b"xmlns:" + prefix
    return (declaration, declaration + b"='" + uri.encode() + b"'",
            declaration + b'="' + uri.encode() + b'"')


_PLUS_BINDING, _RDF_BINDING = _binding(b"plus", PLUS_NS), _binding(b"rdf", RDF_NS)


def plain_data_mining(body: bytes) -> str | None:
    """The PLUS term of a packet that is certainly well-formed and names plus:DataMining
    exactly once, as `<plus:DataMining>value</plus:DataMining>` or as an attribute of
    `rdf:Description`, with a value from the vocabulary; None wherever it is not sure
    (the caller then parses the packet whole)."""
    term = plain_term(body)
    if term is None or not _well_formed(body):
        return None
    return term


def plain_term(body: bytes) -> str | None:
    """`plain_data_mining` without expat's check: the term the packet says in one of the
    plain forms, which is what the full parse reads wherever the packet is well-formed."""
    # Comments, CDATA, a DTD, processing instructions: `<` can hide there. A byte test
    # first (memchr): a 2-byte search of the whole packet costs 5x more, for each of two.
    if (_BANG in body and b"<!" in body) or (_QUESTION in body and b"<?" in body):
        return None
    value = _plain_value(body)
    if value is None:
        return None
    term = value.decode("utf-8", "replace").strip().removeprefix(PLUS_VOCAB)
    return term if term in DATA_MINING else None


_BANG, _QUESTION = ord("!"), ord("?")


def _only_bound_to(body: bytes, declaration: bytes, single: bytes, double: bytes) -> bool:
    """Every `xmlns:prefix` in the packet binds the prefix to the one URI (written
    plainly, in `single` or `double` quotes: `_binding`)."""
    at = body.find(declaration)
    if at < 0:
        return True
    if body.find(declaration, at + len(declaration)) < 0:  # most packets: one declaration
        return body.startswith(single, at) or body.startswith(double, at)
    return body.count(declaration) == body.count(single) + body.count(double)


def _plain_value(body: bytes) -> bytes | None:
    """The raw value of the one plus:DataMining property, in either plain form. Without
    comments, CDATA and PIs, every `<` of a well-formed packet starts a tag, so the
    element found is an element and the attribute an attribute of the tag it is in. A
    value with markup or an entity in it is no vocabulary term: the caller is not sure."""
    occurrences = body.count(b"DataMining")
    if not _only_bound_to(body, *_PLUS_BINDING):
        return None
    if occurrences == 2:  # the element form: its start and end tags
        start = body.find(_PLUS_ELEMENT_OPEN) + len(_PLUS_ELEMENT_OPEN)
        end = body.find(_PLUS_ELEMENT_CLOSE, start)
        if start < len(_PLUS_ELEMENT_OPEN) or end < 0:
            return None
        return body[start:end]  # markup or an entity in it: no vocabulary term, not sure
    if occurrences == 1:  # the attribute form, in the tag around the one occurrence
        tag = body.rfind(b"<", 0, body.find(b"DataMining"))
        match = _PLUS_ATTRIBUTE.match(body, tag) if tag >= 0 else None
        if match is None or not _only_bound_to(body, *_RDF_BINDING):
            return None
        return match.group(1) if match.group(1) is not None else match.group(2)
    return None


def _well_formed(body: bytes) -> bool:
    """What ElementTree would accept: well-formed, every prefix bound (expat, no tree)."""
    try:
        expat.ParserCreate(None, "}").Parse(body, True)
    except expat.ExpatError:
        return False
    return True


def packet_body(packet: bytes) -> bytes:
    """The `<x:xmpmeta>` (or bare `<rdf:RDF>`) element without the `<?xpacket?>` lines and
    padding around it."""
    start = packet.find(b"<x:xmpmeta")
    if start < 0:
        start = packet.find(b"<rdf:RDF")
    end_tag = b"</x:xmpmeta>" if packet[start:start + 10] == b"<x:xmpmeta" else b"</rdf:RDF>"
    end = packet.rfind(end_tag)
    if start < 0 or end < 0:
        return packet  # let the parser say what is wrong
    return packet[start:end + len(end_tag)]


def _data_mining_values(root: ElementTree.Element) -> Iterable[str]:
    tag = f"{{{PLUS_NS}}}DataMining"
    for description in root.iter(f"{{{RDF_NS}}}Description"):
        if tag in description.attrib:
            yield description.attrib[tag].strip()
    for element in root.iter(tag):
        resource = element.attrib.get(f"{{{RDF_NS}}}resource")
        yield (resource if resource is not None else "".join(element.itertext())).strip()


def _data_mining_finding(value: str) -> Finding:
    term = value.removeprefix(PLUS_VOCAB)
    finding = _TERM_FINDINGS.get(term)
    if finding is None:  # a value outside the vocabulary: read as the strictest
        return Finding("xmp", f"plus:DataMining={value} (not in the PLUS vocabulary)",
                       PROHIBITED)
    return finding


# ------------------------------------------------------------------ C2PA

def c2pa_findings(data: bytes, mime: str, parts: tuple[bytes | memoryview, ...] = ()
                  ) -> list[Finding]:
    """The training-mining entries of every manifest in the store (the active one and its
    ingredients'); a store that c2pa-python cannot read is a prohibition with its error.

    A prohibition read from the store's `parts` directly (`jumbf.py`, ~0.1 ms) is final:
    c2pa-python would find the same or refuse the manifest, a prohibition either way. Any
    other answer, and a direct read that is not certain, goes to c2pa-python (~1-4 ms)."""
    if parts:
        try:
            findings = training_mining_findings(direct_store(parts, mime))
        except jumbf.Uncertain:
            findings = []
        if any(f.status == PROHIBITED for f in findings):
            return findings
    return _c2pa_python_findings(data, mime)


def direct_store(parts: tuple[bytes | memoryview, ...], mime: str) -> dict:
    """The training-mining assertions of the store the segments or chunks hold, in c2pa's
    JSON shape; `jumbf.Uncertain` where the direct read cannot be sure."""
    store = jumbf.jpeg_store(parts) if mime == "image/jpeg" else jumbf.single_store(parts)
    return jumbf.training_mining_store(store)


def _c2pa_python_findings(data: bytes, mime: str) -> list[Finding]:
    try:
        import c2pa
    except ImportError:
        return [Finding("c2pa", "manifest present but c2pa-python is not installed",
                        PROHIBITED)]
    try:
        with c2pa.Reader(mime, io.BytesIO(data), context=_reading_context()) as reader:
            store = json.loads(reader.json())
    except Exception as exc:  # c2pa raises its own error types for every kind of damage
        return [Finding("c2pa", f"unreadable manifest ({type(exc).__name__}: "
                                f"{str(exc)[:200]})", PROHIBITED)]
    failures = load_failures(store)
    if failures:
        return [Finding("c2pa", f"unreadable manifest ({'; '.join(failures)[:200]})",
                        PROHIBITED)]
    return training_mining_findings(store)


def load_failures(store: Mapping) -> list[str]:
    """What c2pa could not load. It raises on a damaged store, but a manifest whose
    assertion does not decode it leaves out of `manifests` and names only in the validation
    failures (which, verification being off, are load failures): read as unreadable, or
    a damaged manifest would pass for one without a reservation."""
    results = store.get("validation_results") or {}
    deltas = [results.get("activeManifest") or {}]
    deltas += [d.get("validationDeltas") or {} for d in results.get("ingredientDeltas") or []]
    failures = [f"{f.get('code')}: {f.get('explanation')}" for delta in deltas
                for f in delta.get("failure") or []]
    if not failures and store.get("active_manifest") not in (store.get("manifests") or {}):
        failures.append("the active manifest did not load")
    return failures


@functools.cache
def _reading_context() -> Any:
    """c2pa's reader without signature and hash verification (once per process): a
    reservation binds whoever signed it, trusted or not, and an unverified `allowed` lifts
    nothing, so verifying would only double the read (4 ms against 9 ms an image)."""
    import c2pa

    return c2pa.Context.from_dict({"verify": {"verify_after_reading": False}})


def training_mining_findings(store: Mapping) -> list[Finding]:
    """Entries of the `*.training-mining` assertions of a manifest store (c2pa's JSON)."""
    findings = []
    for manifest in (store.get("manifests") or {}).values():
        for assertion in manifest.get("assertions") or []:
            label = str(assertion.get("label", ""))
            if not label.startswith(TRAINING_MINING_LABELS):
                continue
            entries = (assertion.get("data") or {}).get("entries") or {}
            for name, entry in sorted(entries.items()):
                if name.rpartition(".")[2] not in TRAINING_USES:
                    continue
                use = str((entry or {}).get("use"))
                status = C2PA_USE.get(use, PROHIBITED)  # an unknown use: the strictest
                findings.append(Finding("c2pa", f"{name}={use}", status))
    return findings


# ------------------------------------------------------------------ sidecar and domains

def sidecar_findings(sidecar: Mapping[str, object]) -> list[Finding]:
    """`X-Robots-Tag` and TDMRep values a crawler kept beside the image."""
    keys = _reserving_keys(tuple(sidecar))
    if not keys:  # most sidecars: neither
        return []
    fields = {name: sidecar[key] for key, name in keys}  # a later spelling wins, as before
    findings = []
    robots = fields.get("x-robots-tag")
    if robots:
        # `noai, noimageai`, or per agent: `otherbot: noai`.
        tokens = {t.strip().lower() for t in re.split(r"[,\s:]+", str(robots)) if t.strip()}
        for token in sorted(tokens & ROBOTS_RESERVED):
            findings.append(Finding("x-robots-tag", token, PROHIBITED))
    reservation = fields.get("tdm-reservation")
    if reservation is not None and str(reservation).strip() not in ("", "0"):
        policy = fields.get("tdm-policy")
        if str(reservation).strip() != "1":
            findings.append(Finding("tdmrep", f"tdm-reservation={reservation} (unreadable)",
                                    PROHIBITED))
        elif policy:  # reserved, but a policy says on which terms mining is licensed
            findings.append(Finding("tdmrep", f"tdm-reservation=1 tdm-policy={policy}",
                                    CONSTRAINED))
        else:
            findings.append(Finding("tdmrep", "tdm-reservation=1", PROHIBITED))
    return findings


_SIDECAR_FIELDS = frozenset({"x-robots-tag", "tdm-reservation", "tdm-policy"})


@functools.lru_cache(maxsize=64)
def _reserving_keys(keys: tuple) -> tuple[tuple[Any, str], ...]:
    """The sidecar keys that name a reservation field (any case, `_` for `-`), each with
    that field's name. Kept per key set: a crawl's sidecars share a handful of them."""
    named = ((key, str(key).lower().replace("_", "-")) for key in keys)
    return tuple((key, name) for key, name in named if name in _SIDECAR_FIELDS)


@dataclass(frozen=True)
class DomainList:
    """Domains (a listed domain covers its subdomains) and URL prefixes whose owners
    reserved their works, one per line (`#` comments); see `parse_domain_list`."""

    domains: frozenset[str] = frozenset()
    prefixes: tuple[str, ...] = field(default=())

    def __bool__(self) -> bool:
        return bool(self.domains or self.prefixes)

    def findings(self, url: str) -> list[Finding]:
        for prefix in self.prefixes:
            if url.startswith(prefix):
                return [Finding("domain", prefix, PROHIBITED)]
        host = (urlsplit(url).hostname or "").lower()
        parts = host.split(".")
        for n in range(len(parts) - 1):
            domain = ".".join(parts[n:])
            if domain in self.domains:
                return [Finding("domain", domain, PROHIBITED)]
        return []


def parse_domain_list(text: str) -> DomainList:
    """`example.com` (and its subdomains) or `https://example.org/gallery/` (a prefix)."""
    domains, prefixes = set(), []
    for line in text.splitlines():
        entry = line.split("#", 1)[0].strip()
        if not entry:
            continue
        if "://" in entry:
            prefixes.append(entry)
        else:
            domains.add(entry.lower().strip(".").removeprefix("*."))
    return DomainList(frozenset(domains), tuple(sorted(prefixes)))
