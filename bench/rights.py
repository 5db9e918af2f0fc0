"""Ingest: the cost of reading training reservations (issue 46), as raw rows/s of the
ingest's per-row work (`raw_row`: header probe, sha256, provenance, and the signal readers)
with the readers against the same work without them (`read_rights=False`).

Two sets of real photos (scikit-image's samples at their own sizes, 0.1-2 MP, as JPEG, PNG
and WebP): `plain`, without XMP or a C2PA manifest (what most of a crawl is: the readers
cost a walk of the segment headers only), and `mixed`: half of them carrying XMP written by
exiftool (plus:DataMining in element and attribute form, and each file its own
xmpMM:DocumentID, InstanceID and OriginalDocumentID, so that no two packets are alike, as
in a crawl: nothing read once is reused) and one in sixteen a C2PA "do not train" manifest
signed by c2pa-python (read from its JUMBF boxes), every one with a crawler's `.json`
sidecar. The bytes are in memory: reading the file is the same with or without the readers,
so leaving it out makes the readers' share larger, not smaller.

Measured in pairs: one pass over the set with the readers and one without, back to back
(which goes first swaps each pair), in this thread's CPU seconds, so that the load of a
shared machine falls on both halves of a pair alike. A pair's cost is its with/without
ratio less one; the figure is the median over the pairs, with the quartiles and a 95 %
confidence interval of the median (order statistics: no assumption about the spread).
Target: ≤ 5 % slower.
"""

from __future__ import annotations

import math
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.common import OUT, Figure, report
from prx_assets.stages.ingest import rights
from prx_assets.stages.ingest.raw_rows import FoundItem, raw_row
from prx_assets.testing import rights_fixtures as rf

PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "camera", "immunohistochemistry",
          "hubble_deep_field", "retina", "brick", "moon", "cat", "colorwheel")
FORMATS = ("jpeg", "jpeg", "png", "webp")  # JPEG most of a crawl
PAIRS = int(os.environ.get("PRX_BENCH_RIGHTS_PAIRS", "300"))  # ≈ 8 s a set


def _sidecar(n: int) -> dict:
    return {"url": f"https://photos.example.org/{n}.jpg", "license": "cc-by-4.0",
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
    rf.tag_files(work, tagged, document_ids=True)  # one exiftool process
    for path, _, _ in tagged:
        mixed[int(path.stem)] = path.read_bytes()
    return {"plain": plain, "mixed": [FoundItem(key=item.key, data=mixed[n], meta=_sidecar(n))
                                      for n, item in enumerate(plain)]}


def one_pass(items: list[FoundItem], read_rights: bool) -> float:
    """CPU seconds of one pass of `raw_row` over the set, every packet read as the first
    time (the findings kept per packet forgotten: in an ingest each file comes once)."""
    rights.forget_findings()
    start = time.thread_time()
    for item in items:
        raw_row("bench", item, source_license="cc0", read_rights=read_rights)
    return time.thread_time() - start


@dataclass(frozen=True)
class Cost:
    """Per-pair costs (with/without - 1) of one set, and the medians of each half."""

    costs: list[float]
    with_seconds: float
    without_seconds: float

    def quantile(self, q: float) -> float:
        ordered = sorted(self.costs)
        return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]

    def median_interval(self) -> tuple[float, float]:
        """95 % confidence interval of the median: the order statistics n/2 ± 0.98 √n."""
        ordered, n = sorted(self.costs), len(self.costs)
        half = 0.98 * math.sqrt(n)
        low, high = math.floor(n / 2 - half), math.ceil(n / 2 + half)
        return ordered[max(0, low)], ordered[min(n - 1, high)]


def paired_costs(items: list[FoundItem], pairs: int) -> Cost:
    for read_rights in (True, False):  # warm: imports, caches, c2pa's context
        one_pass(items, read_rights)
    costs, with_seconds, without_seconds = [], [], []
    for n in range(pairs):
        seconds = {}
        for flag in ((False, True) if n % 2 == 0 else (True, False)):
            seconds[flag] = one_pass(items, flag)
        costs.append(seconds[True] / seconds[False] - 1)
        with_seconds.append(seconds[True])
        without_seconds.append(seconds[False])
    return Cost(costs, statistics.median(with_seconds), statistics.median(without_seconds))


def bench_set(name: str, items: list[FoundItem], pairs: int = PAIRS) -> Cost:
    reserved = sum(raw_row("bench", i)["reservation"] != "none" for i in items)
    load = os.getloadavg()[0]
    cost = paired_costs(items, pairs)
    low, high = cost.median_interval()
    megabytes = sum(len(i.data or b"") for i in items) / len(items) / 1e6
    print(f"rights readers, {name} photos ({len(items)}, {megabytes:.2f} MB each on average, "
          f"{reserved} reserved), {pairs} pairs, load {load:.1f} -> {os.getloadavg()[0]:.1f}: "
          f"without {len(items) / cost.without_seconds:.0f} rows/CPU-s, with "
          f"{len(items) / cost.with_seconds:.0f}: cost {cost.quantile(0.5) * 100:.2f} % "
          f"(95 % CI of the median {low * 100:.2f}-{high * 100:.2f}, quartiles "
          f"{cost.quantile(0.25) * 100:.2f}-{cost.quantile(0.75) * 100:.2f})")
    return cost


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
            cost = bench_set(name, items)
            figures.append(Figure("ingest", f"rows/CPU-s, rights, {name}",
                                  len(items) / cost.with_seconds, "ingest rows without readers",
                                  len(items) / cost.without_seconds, "row/s"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(figures, "rights")


if __name__ == "__main__":
    main()
