"""Images carrying real training reservations, for the tests and the rights bench: XMP
`plus:DataMining` written by exiftool (Debian's `libimage-exiftool-perl`) in the element and
the attribute form, C2PA manifests signed by c2pa-python with a locally made ES256 chain,
and the damaged variants (a malformed packet, a corrupt manifest).

exiftool 12.57 (Debian 12) predates `plus:DataMining`, so the tag is declared in a config
file (`PLUS_CONFIG`); newer versions know it and write the same XMP. All files of a call go
through one exiftool process (`-@ argfile`, `-execute` per file): perl starts once.
"""

from __future__ import annotations

import datetime
import io
import shutil
import subprocess
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from prx_assets.stages.ingest.rights import PLUS_VOCAB

PLUS_CONFIG = """%Image::ExifTool::UserDefined = (
    'Image::ExifTool::PLUS::XMP' => { DataMining => { } },
);
1;
"""
FORMATS = {"jpeg": ("jpg", "JPEG", "image/jpeg"), "png": ("png", "PNG", "image/png"),
           "webp": ("webp", "WEBP", "image/webp")}
FORMS = ("element", "attribute")


def exiftool_available() -> bool:
    return shutil.which("exiftool") is not None


def photo(fmt: str, size: int = 96, which: str = "astronaut") -> bytes:
    """A real photo (scikit-image's samples) at `size` px, encoded as `fmt`."""
    from PIL import Image
    from skimage import data

    image = Image.fromarray(getattr(data, which)()).convert("RGB").resize((size, size))
    out = io.BytesIO()
    image.save(out, FORMATS[fmt][1], quality=90)
    return out.getvalue()


@dataclass(frozen=True)
class XmpFixture:
    fmt: str
    form: str
    value: str  # a PLUS term, e.g. DMI-PROHIBITED-AIMLTRAINING
    path: Path


def write_data_mining(folder: Path, cases: list[tuple[str, str, str]], size: int = 96,
                      which: str = "astronaut") -> list[XmpFixture]:
    """One image per (format, form, PLUS term), written by exiftool into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    made = []
    for fmt, form, value in cases:
        path = folder / f"{value}.{form}.{FORMATS[fmt][0]}"
        path.write_bytes(photo(fmt, size, which))
        made.append(XmpFixture(fmt, form, value, path))
    tag_files(folder, [(f.path, f.form, f.value) for f in made])
    return made


def tag_files(folder: Path, files: list[tuple[Path, str, str]],
              document_ids: bool = False) -> None:
    """Write plus:DataMining (a PLUS term) into each file in place, in the element or the
    attribute form: one exiftool process for all of them. With `document_ids`, each file
    also gets its own xmpMM:DocumentID, InstanceID and OriginalDocumentID, as editors
    stamp them: no two packets are alike, as in a crawl."""
    config = folder / "plus.config"
    config.write_text(PLUS_CONFIG)
    args: list[str] = []
    for path, form, value in files:
        args += (["-api", "Compact=Shorthand"] if form == "attribute" else [])
        args += ["-q", "-overwrite_original", f"-XMP-plus:DataMining={PLUS_VOCAB}{value}"]
        if document_ids:
            args += [f"-XMP-xmpMM:{name}=xmp.{kind}:{uuid.uuid4()}" for name, kind in
                     (("DocumentID", "did"), ("InstanceID", "iid"),
                      ("OriginalDocumentID", "did"))]
        args += [str(path), "-execute"]
    argfile = folder / "args.txt"
    argfile.write_text("\n".join(args) + "\n")
    subprocess.run(["exiftool", "-config", str(config), "-@", str(argfile)], check=True,
                   capture_output=True)


def malformed_xmp(data: bytes) -> bytes:
    """An image whose XMP packet names DataMining but is not well-formed XML (same length:
    the segment lengths still hold)."""
    broken = data.replace(b"</rdf:RDF>", b"</rdf:RDX>", 1)
    assert broken != data, "no XMP packet to break"
    return broken


# ------------------------------------------------------------------ C2PA

@cache
def signing_chain() -> tuple[bytes, bytes]:
    """(certificate chain PEM: signer then CA, signer key PEM): ES256, made once per process.
    c2pa-rs wants a CA-issued end-entity certificate with an allowed extended key usage."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn),
                          x509.NameAttribute(NameOID.ORGANIZATION_NAME, "prx-assets tests")])

    def usage(signs_certs: bool) -> x509.KeyUsage:
        return x509.KeyUsage(digital_signature=True, content_commitment=False,
                             key_encipherment=False, data_encipherment=False,
                             key_agreement=False, key_cert_sign=signs_certs,
                             crl_sign=signs_certs, encipher_only=False, decipher_only=False)

    now = datetime.datetime.now(datetime.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())

    def certificate(subject: str, issuer: x509.Name, public_key, ca: bool) -> x509.Certificate:
        builder = (x509.CertificateBuilder().subject_name(name(subject)).issuer_name(issuer)
                   .public_key(public_key).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(days=1))
                   .not_valid_after(now + datetime.timedelta(days=3650))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
                   .add_extension(usage(ca), critical=True)
                   .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key),
                                  critical=False))
        if not ca:
            builder = builder.add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.EMAIL_PROTECTION]), critical=False
            ).add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                ca_key.public_key()), critical=False)
        return builder.sign(ca_key, hashes.SHA256())

    ca = certificate("prx-assets test CA", name("prx-assets test CA"), ca_key.public_key(),
                     True)
    leaf = certificate("prx-assets test signer", ca.subject, key.public_key(), False)
    pem = serialization.Encoding.PEM
    chain = leaf.public_bytes(pem) + ca.public_bytes(pem)
    private = key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return chain, private


def sign_training_mining(data: bytes, mime: str, uses: Mapping[str, str] | None,
                         label: str = "cawg.training-mining",
                         ingredient: bytes | None = None) -> bytes:
    """`data` with an embedded C2PA manifest whose `label` assertion gives each entry
    (`ai_training`, `ai_generative_training`, ...) its `use` (`uses=None`: no such
    assertion); with `ingredient` (a signed image of the same type) as its parent, whose
    manifest the store then holds too."""
    import c2pa

    prefix = label.split(".")[0]
    assertions: list[dict] = [{"label": "c2pa.actions", "data": {"actions": [{
        "action": "c2pa.created",
        "digitalSourceType": "http://cv.iptc.org/newscodes/digitalsourcetype/digitalCapture",
    }]}}]
    if uses is not None:
        assertions.append({"label": label, "data": {"entries": {
            f"{prefix}.{entry}": {"use": use} for entry, use in uses.items()}}})
    manifest = {"claim_generator_info": [{"name": "prx-assets tests", "version": "1"}],
                "title": "reserved", "assertions": assertions}
    chain, key = signing_chain()
    signer = c2pa.Signer.from_info(c2pa.C2paSignerInfo(
        alg=b"es256", sign_cert=chain, private_key=key, ta_url=None))
    out = io.BytesIO()
    with c2pa.Builder(manifest) as builder:
        if ingredient is not None:
            builder.add_ingredient({"title": "parent", "relationship": "parentOf"}, mime,
                                   io.BytesIO(ingredient))
        builder.sign(signer, mime, io.BytesIO(data), out)
    return out.getvalue()


def corrupt_manifest(signed_jpeg: bytes) -> bytes:
    """A signed JPEG whose JUMBF box headers are garbled (the segment still says APP11)."""
    start = signed_jpeg.find(b"\xff\xeb")
    assert start >= 0, "no APP11 segment"
    body = start + 4 + 8  # marker, length, then the JP common header the reader checks
    garbled = bytes(b ^ 0x5A for b in signed_jpeg[body:body + 64])
    return signed_jpeg[:body] + garbled + signed_jpeg[body + 64:]


# ------------------------------------------------------------------ a source of them

@dataclass(frozen=True)
class SignalSample:
    """One WebDataset sample: its image member, its `.json` sidecar, and the reservation
    ingest must read from the two (`none`, `constrained` or `prohibited`)."""

    key: str
    ext: str
    data: bytes
    sidecar: dict
    status: str


RESERVED_DOMAIN = "reserved.example"
PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "camera", "immunohistochemistry",
          "hubble_deep_field", "retina", "brick", "moon")


def signal_samples(folder: Path, size: int = 448) -> list[SignalSample]:
    """A sample per kind of signal, each a different real photo (none is a duplicate of
    another): plain, XMP element and attribute forms in JPEG/PNG/WebP, C2PA, a corrupt
    manifest, X-Robots-Tag, TDMRep and a URL on `RESERVED_DOMAIN`. The XMP cases need
    exiftool, the C2PA ones c2pa-python."""
    xmp = write_data_mining(folder, [("jpeg", "element", "DMI-PROHIBITED-GENAIMLTRAINING")],
                            size, PHOTOS[1])
    xmp += write_data_mining(folder, [("png", "attribute", "DMI-PROHIBITED-SEECONSTRAINT")],
                             size, PHOTOS[2])
    xmp += write_data_mining(folder, [("webp", "element", "DMI-ALLOWED")], size, PHOTOS[3])
    signed = sign_training_mining(photo("jpeg", size, PHOTOS[4]), "image/jpeg",
                                  {"ai_generative_training": "notAllowed"})
    broken = corrupt_manifest(sign_training_mining(photo("jpeg", size, PHOTOS[5]),
                                                   "image/jpeg", {"ai_training": "allowed"}))

    def url(n: int, host: str = "photos.example.org") -> dict:
        return {"url": f"https://{host}/{n}.jpg", "caption": f"photo number {n}",
                "license": "cc-by-4.0", "attribution": f"Photographer {n}"}

    return [
        SignalSample("s0", "jpg", photo("jpeg", size, PHOTOS[0]), url(0), "none"),
        SignalSample("s1", "jpg", xmp[0].path.read_bytes(), url(1), "prohibited"),
        SignalSample("s2", "png", xmp[1].path.read_bytes(), url(2), "constrained"),
        SignalSample("s3", "webp", xmp[2].path.read_bytes(), url(3), "none"),
        SignalSample("s4", "jpg", signed, url(4), "prohibited"),
        SignalSample("s5", "jpg", broken, url(5), "prohibited"),
        SignalSample("s6", "jpg", photo("jpeg", size, PHOTOS[6]),
                     {**url(6), "X-Robots-Tag": "noai"}, "prohibited"),
        SignalSample("s7", "jpg", photo("jpeg", size, PHOTOS[7]),
                     {**url(7), "tdm-reservation": 1}, "prohibited"),
        # No signal in the file or the sidecar: the domain list (read by the readers of the
        # table, not at ingest) withholds it.
        SignalSample("s8", "jpg", photo("jpeg", size, PHOTOS[8]),
                     url(8, f"cdn.{RESERVED_DOMAIN}"), "none"),
        SignalSample("s9", "jpg", photo("jpeg", size, PHOTOS[9]), url(9), "none"),
    ]


def write_signal_tar(path: Path, samples: list[SignalSample]) -> Path:
    """The samples as one WebDataset shard (`<key>.<ext>` and `<key>.json`)."""
    import json
    import tarfile

    from prx_assets.testing.tars import add_member

    with tarfile.open(path, "w") as tar:
        for sample in samples:
            add_member(tar, f"{sample.key}.{sample.ext}", sample.data)
            add_member(tar, f"{sample.key}.json", json.dumps(sample.sidecar).encode())
    return path
