"""Chroma subsampling at Q92: size and PSNR of 4:4:4 against 4:2:0 on real photos
(scikit-image / matplotlib samples, cropped and rescaled to bucket shapes)."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from bench.common import Figure, report
from prx_assets.demo.corpus import photo_variant, real_photo_paths
from prx_assets.stages.images.buckets import assign_bucket
from prx_assets.stages.images.fidelity import cycle_psnr, psnr
from prx_assets.stages.images.imaging import ImageOptions, encode_jpeg, resize_to_shape, to_rgb


def bucketed_photos(n: int = 48) -> list[Image.Image]:
    rng = np.random.default_rng(5)
    photos = [Image.open(p) for p in real_photo_paths()]
    out = []
    for i in range(n):
        img = to_rgb(photo_variant(rng, photos[i % len(photos)]))
        bucket = assign_bucket(*img.size)
        if bucket.status == "ok":
            out.append(resize_to_shape(img, bucket.shape, ImageOptions()))
    return out


def main() -> list[Figure]:
    images = bucketed_photos()
    stats = {}
    for mode in ("4:4:4", "4:2:0"):
        sizes, first, tenth = [], [], []
        for img in images:
            data = encode_jpeg(img, 92, mode)
            sizes.append(len(data))
            decoded = Image.open(io.BytesIO(data)).convert("RGB")
            first.append(psnr(np.asarray(img), np.asarray(decoded)))
            tenth.append(cycle_psnr(np.asarray(img), 92, mode, (10,))[10])
        stats[mode] = (np.mean(sizes) / 1e3, np.median(first), np.median(tenth))
    print(f"subsampling on {len(images)} real-photo buckets: " + "; ".join(
        f"{m}: {s:.0f} kB, PSNR vs source {p:.2f} dB, 10 cycles {t:.2f} dB"
        for m, (s, p, t) in stats.items()))
    figures = [
        Figure("jpeg", "4:4:4 size (kB)", stats["4:4:4"][0], "4:2:0", stats["4:2:0"][0], "kB"),
        Figure("jpeg", "4:4:4 PSNR vs source (dB)", stats["4:4:4"][1], "4:2:0",
               stats["4:2:0"][1], "dB"),
    ]
    report(figures, "subsampling")
    return figures


if __name__ == "__main__":
    main()
