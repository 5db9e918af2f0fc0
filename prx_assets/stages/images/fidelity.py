"""JPEG fidelity: PSNR after repeated decode/encode cycles at the pipeline's quality.

The design's reference figures (PSNR after 1 and 10 re-encodes at Q92) are reported alongside.
"""

from __future__ import annotations

import heapq
import io
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image

from prx_assets.stages.images.buckets import assign_bucket
from prx_assets.stages.images.imaging import (
    ImageOptions,
    encode_jpeg,
    oriented_rgb,
    oriented_size,
    resize_to_shape,
)
from prx_assets.storage.filters import in_filter
from prx_assets.storage.refs import TableRef

if TYPE_CHECKING:
    import lance

# (label, low MP, high MP) and the published (1x, 10x) PSNR in dB for that band.
BANDS = {"0.25-0.5 MP": (0.25, 0.5), "1-2 MP": (1.0, 2.0)}
PUBLISHED_DB = {"0.25-0.5 MP": (45.1, 42.2), "1-2 MP": (48.7, 45.4)}


def psnr(reference: np.ndarray, other: np.ndarray) -> float:
    """PSNR in dB of two 8-bit images of one shape (inf when they are equal)."""
    if reference.dtype == np.uint8 and other.dtype == np.uint8:
        # The squared errors summed exactly in integers: the same mean as float64's (every
        # partial sum is an integer below 2^53), without two float64 copies of each image.
        diff = np.subtract(reference, other, dtype=np.int64).ravel()
        mse = float(np.dot(diff, diff)) / diff.size
    else:
        mse = float(np.mean((reference.astype(np.float64) - other.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else float(10 * np.log10(255.0**2 / mse))


def decode_rgb(data: bytes) -> np.ndarray:
    return np.asarray(_decoded(data))


def _decoded(data: bytes) -> Image.Image:
    """A JPEG decoded to RGB (no copy when it is RGB already)."""
    image = Image.open(io.BytesIO(data))
    return image if image.mode == "RGB" else image.convert("RGB")


def cycle_psnr(reference: np.ndarray, quality: int, subsampling: str,
               cycles: tuple[int, ...] = (1, 10)) -> dict[int, float]:
    """PSNR against the lossless `reference` after n encode(Q) -> decode cycles. The image
    stays a PIL image between cycles: an array is made only where a PSNR is measured."""
    current, results = Image.fromarray(reference), {}
    for n in range(1, max(cycles) + 1):
        current = _decoded(encode_jpeg(current, quality, subsampling))
        if n in cycles:
            results[n] = psnr(reference, np.asarray(current))
    return results


def lossless_bucket(original: bytes, options: ImageOptions) -> np.ndarray:
    """The bucket image as the pipeline would make it before JPEG: full decode, no shortcuts."""
    image = Image.open(io.BytesIO(original))
    bucket = assign_bucket(*oriented_size(image), options.rule)
    assert bucket.shape is not None, bucket.status  # callers pass bucketable images only
    exact = ImageOptions(rule=options.rule, resize_mode=options.resize_mode, reducing_gap=None)
    return np.asarray(resize_to_shape(oriented_rgb(image), bucket.shape, exact))


def band_of(width: int, height: int) -> str | None:
    mp = width * height / 1e6
    return next((label for label, (lo, hi) in BANDS.items() if lo <= mp < hi), None)


@dataclass
class BandReport:
    band: str
    samples: int = 0
    psnr_1x: list[float] = field(default_factory=list)
    psnr_10x: list[float] = field(default_factory=list)
    psnr_stored: list[float] = field(default_factory=list)

    def stats(self) -> dict:
        def summary(values: list[float]) -> tuple[float, float]:
            finite = [v for v in values if np.isfinite(v)] or [99.0]
            return float(np.median(finite)), float(np.percentile(finite, 10))

        (m1, p1), (m10, p10) = summary(self.psnr_1x), summary(self.psnr_10x)
        stored, _ = summary(self.psnr_stored)
        pub1, pub10 = PUBLISHED_DB[self.band]
        return {"band": self.band, "samples": self.samples, "median_1x": round(m1, 2),
                "p10_1x": round(p1, 2), "median_10x": round(m10, 2), "p10_10x": round(p10, 2),
                "published_1x": pub1, "published_10x": pub10,
                "median_stored": round(stored, 2)}


def deterministic_sample(bucketed: TableRef, per_band: int) -> dict[str, list[str]]:
    """The `per_band` smallest ids (ids are hashes: an unbiased, stable sample) per band."""
    heaps: dict[str, list[_Desc]] = {band: [] for band in BANDS}
    table = bucketed.open()
    for batch in table.to_batches(columns=["id", "width", "height"], filter="status = 'ok'"):
        data = batch.to_pydict()
        for sample_id, w, h in zip(data["id"], data["width"], data["height"], strict=True):
            band = band_of(w, h)
            if band is None:
                continue
            heap = heaps[band]  # max-heap of the smallest ids, via negated ordering
            item = _Desc(sample_id)
            if len(heap) < per_band:
                heapq.heappush(heap, item)
            elif item.value < heap[0].value:
                heapq.heapreplace(heap, item)
    return {band: sorted(i.value for i in heap) for band, heap in heaps.items()}


class _Desc:
    __slots__ = ("value",)

    def __init__(self, value: str):
        self.value = value

    def __lt__(self, other: _Desc) -> bool:
        return self.value > other.value


def fidelity_report(bucketed_table: TableRef, raw_table: TableRef, options: ImageOptions,
                    per_band: int = 16) -> list[BandReport]:
    """Per band: PSNR of 1 and 10 Q-encodes of the lossless bucket image (what the reference
    measured), and of the stored JPEG against it (JPEG plus our decode/resize shortcuts)."""
    bucketed, raw = bucketed_table.open(), raw_table.open()
    reports = []
    for band, ids in deterministic_sample(bucketed_table.at(bucketed.version), per_band).items():
        report = BandReport(band)
        if ids:
            stored = dict(_rows(bucketed, ["id", "image"], ids))
            originals = dict(_rows(raw, ["id", "image"], ids))
            for sample_id in ids:
                reference = lossless_bucket(originals[sample_id], options)
                result = cycle_psnr(reference, options.quality, options.subsampling)
                report.psnr_1x.append(result[1])
                report.psnr_10x.append(result[10])
                report.psnr_stored.append(psnr(reference, decode_rgb(stored[sample_id])))
                report.samples += 1
        reports.append(report)
    return reports


def _rows(table: lance.LanceDataset, columns: list[str], ids: list[str]):
    data = table.to_table(columns=columns, filter=in_filter("id", ids)).to_pydict()
    return zip(data[columns[0]], data[columns[1]], strict=True)
