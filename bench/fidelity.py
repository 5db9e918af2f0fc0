"""The jpeg_fidelity check's kernel (1 and 10 Q92 encode/decode cycles of a lossless bucket
image, PSNR after each measured cycle) against the same cycles done the way the check did
them before session 10: a numpy array between cycles and float64 copies for each PSNR. Both
must give the same numbers (asserted); the figure is CPU seconds, rounds alternating the
order, the median of per-round ratios.

Images: real photos (scikit-image / matplotlib samples in bucket shapes, `bench.subsampling`)
and generated JPEGs at two sizes (0.3 and 1.5 MP, the check's two bands).
"""

from __future__ import annotations

import io
import os
import time
from collections.abc import Callable

import numpy as np
from PIL import Image

from bench.common import Figure, report
from bench.subsampling import bucketed_photos
from prx_assets.stages.images.fidelity import cycle_psnr
from prx_assets.stages.images.imaging import encode_jpeg
from prx_assets.testing.images import jpeg_bytes

Cycles = Callable[[np.ndarray, int, str], dict[int, float]]


def arrays_and_float64(reference: np.ndarray, quality: int, subsampling: str,
                       cycles: tuple[int, ...] = (1, 10)) -> dict[int, float]:
    """The baseline: the check's cycles as they were (an array and a fresh RGB copy each
    cycle, the PSNR on float64 copies)."""
    current, results = reference, {}
    for n in range(1, max(cycles) + 1):
        data = encode_jpeg(Image.fromarray(current), quality, subsampling)
        current = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
        if n in cycles:
            mse = np.mean((reference.astype(np.float64) - current.astype(np.float64)) ** 2)
            results[n] = float("inf") if mse == 0 else float(10 * np.log10(255.0**2 / mse))
    return results


def references(photos: int) -> dict[str, list[np.ndarray]]:
    generated = {size: [np.asarray(Image.open(io.BytesIO(jpeg_bytes(w, h, seed))).convert("RGB"))
                        for seed in range(4)]
                 for size, (w, h) in {"generated 0.3 MP": (640, 480),
                                      "generated 1.5 MP": (1536, 1024)}.items()}
    return {"real photos": [np.asarray(img) for img in bucketed_photos(photos)], **generated}


def cpu_seconds(fn: Cycles, images: list[np.ndarray]) -> tuple[float, list[dict[int, float]]]:
    started = time.process_time()
    results = [fn(image, 92, "4:4:4") for image in images]
    return time.process_time() - started, results


def measure(images: list[np.ndarray], rounds: int) -> tuple[float, float]:
    """Median CPU seconds of the check's cycles and of the baseline, alternating."""
    ours, base = [], []
    for i in range(rounds):
        order = [(cycle_psnr, ours), (arrays_and_float64, base)]
        seen = []
        for fn, out in order if i % 2 == 0 else order[::-1]:
            seconds, results = cpu_seconds(fn, images)
            out.append(seconds)
            seen.append(results)
        assert seen[0] == seen[1], "the check's PSNRs changed"
    return float(np.median(ours)), float(np.median(base))


def main() -> list[Figure]:
    rounds = int(os.environ.get("PRX_BENCH_ROUNDS", "3"))
    figures = []
    for label, images in references(int(os.environ.get("PRX_BENCH_FIDELITY_PHOTOS", "16"))
                                    ).items():
        ours, base = measure(images, rounds)
        pixels = sum(image.shape[0] * image.shape[1] for image in images) / len(images) / 1e6
        print(f"fidelity, {label} ({len(images)} images, {pixels:.2f} MP mean): {ours:.2f} CPU-s "
              f"against {base:.2f} (same PSNRs)")
        figures.append(Figure("fidelity", f"{label} CPU s", ours, "arrays+float64 per cycle",
                              base, "s"))
    report(figures, "fidelity")
    return figures


if __name__ == "__main__":
    main()
