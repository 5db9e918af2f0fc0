"""Ingest: the cost of reading training reservations (issue 46), as raw rows/s of the
ingest's per-row work (`raw_row`: header probe, sha256, provenance, and the signal readers)
with the readers against the same work without them (`read_rights=False`).

Two sets of real photos (scikit-image's samples at their own sizes, 0.1-2 MP, as JPEG, PNG
and WebP): `plain`, without XMP or a C2PA manifest (what most of a crawl is: the readers
cost a walk of the segment headers only), and `mixed`: half of them carrying XMP written by
exiftool (plus:DataMining in element and attribute form, parsed) and one in sixteen a C2PA
"do not train" manifest signed by c2pa-python (read from its JUMBF boxes), every one with a
crawler's `.json` sidecar. The bytes are in memory: reading the file is the same with or without the
readers, so leaving it out makes the readers' share larger, not smaller.

Runs alternate (which goes first swaps each round), five each, in this process's CPU
seconds (wall time on a shared two-core machine moves by ±30 % between identical runs);
the medians are compared. Target: ≤ 5 % slower on plain photos.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import OUT, Figure, report
from prx_assets.stages.ingest.raw_rows import FoundItem, raw_row
from prx_assets.testing import rights_fixtures as rf

PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "camera", "immunohistochemistry",
          "hubble_deep_field", "retina", "brick", "moon", "cat", "colorwheel")
FORMATS = ("jpeg", "jpeg", "png", "webp")  # JPEG most of a crawl
ROUNDS = 5
PASSES = 3  # passes over the set per run
SIDECAR = {"url": "https://photos.example.org/a.jpg", "license": "cc-by-4.0",
           "attribution": "A. Photographer", "caption": "a photo"}


def _native(which: str, fmt: str) -> bytes:
    """A sample photo at its own size (not resized), encoded as `fmt`."""
    import io

    from PIL import Image
    from skimage import data

    out = io.BytesIO()
    Image.fromarray(getattr(data, which)()).convert("RGB").save(out, rf.FORMATS[fmt][1],
                                                                quality=90)
    return out.getvalue()


def photo_sets(work: Path) -> dict[str, list[FoundItem]]:
    plain = [FoundItem(key=f"{which}.{fmt}", data=_native(which, fmt))
             for which in PHOTOS for fmt in FORMATS]
    mixed: dict[int, bytes] = {}
    tagged: list[tuple[Path, str, str]] = []
    for n, item in enumerate(plain):
        fmt = FORMATS[n % len(FORMATS)]
        data = item.data or b""
        if n % 10 == 0 and fmt == "jpeg":
            data = rf.sign_training_mining(data, "image/jpeg", {"ai_training": "notAllowed"})
        elif n % 2 == 0:
            path = work / f"{n}.{rf.FORMATS[fmt][0]}"
            path.write_bytes(data)
            value = "DMI-PROHIBITED-AIMLTRAINING" if n % 4 == 0 else "DMI-ALLOWED"
            tagged.append((path, "attribute" if n % 3 == 0 else "element", value))
        mixed[n] = data
    rf.tag_files(work, tagged)  # one exiftool process
    for path, _, _ in tagged:
        mixed[int(path.stem)] = path.read_bytes()
    return {"plain": plain, "mixed": [FoundItem(key=item.key, data=mixed[n], meta=SIDECAR)
                                      for n, item in enumerate(plain)]}


def run(items: list[FoundItem], read_rights: bool) -> int:
    rows = 0
    for _ in range(PASSES):
        for item in items:
            raw_row("bench", item, source_license="cc0", read_rights=read_rights)
            rows += 1
    return rows


def bench_set(name: str, items: list[FoundItem]) -> tuple[float, float, int]:
    rates: dict[bool, list[float]] = {True: [], False: []}
    reserved = sum(raw_row("bench", i)["reservation"] != "none" for i in items)
    for round_ in range(ROUNDS):
        for flag in ((False, True) if round_ % 2 == 0 else (True, False)):
            cpu = time.process_time()
            rows = run(items, flag)
            rates[flag].append(rows / (time.process_time() - cpu))
    with_readers, without = statistics.median(rates[True]), statistics.median(rates[False])
    megapixels = sum(len(i.data or b"") for i in items) / len(items) / 1e6
    print(f"rights readers, {name} photos ({len(items)}, {megapixels:.2f} MB each on "
          f"average, {reserved} reserved): without {without:.0f} rows/CPU-s, with "
          f"{with_readers:.0f} (medians of {ROUNDS}): cost "
          f"{(1 - with_readers / without) * 100:.2f} %")
    return with_readers, without, reserved


def main() -> None:
    if not rf.exiftool_available():
        print("rights: exiftool not installed (make install); skipped")
        return
    OUT.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-rights-", dir=OUT))
    try:
        sets = photo_sets(work)
        figures = []
        for name, items in sets.items():
            with_readers, without, _ = bench_set(name, items)
            figures.append(Figure("ingest", f"rows/CPU-s, rights, {name}", with_readers,
                                  "ingest rows without readers", without, "row/s"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(figures, "rights")


if __name__ == "__main__":
    main()
