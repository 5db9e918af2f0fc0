"""Image stage per core: our one-decode kernel (decode, bucket, resize, encode, phash)
against a naive baseline (full decode + plain Lanczos resize + Q92 encode, then
`imagehash.phash` on a second open of the file), on real photos and generated 1-12 MP JPEGs.
Also phash alone against imagehash (speed and bit agreement), and the quality cost of the
shortcuts (PSNR of our output against the exact full-decode path)."""

from __future__ import annotations

import io
import math

import imagehash
import numpy as np
from PIL import Image

from bench.common import Figure, report, timed
from prx_assets.s2_images import phash as phash_mod
from prx_assets.s2_images.buckets import assign_bucket
from prx_assets.s2_images.fidelity import psnr
from prx_assets.s2_images.imaging import ImageOptions, encode_jpeg, process_image, to_rgb
from prx_assets.demo.corpus import encode, photo_variant, procedural_image, real_photo_paths

EXACT = ImageOptions(draft_margin=None, reducing_gap=None)


def naive(data: bytes) -> None:
    img = to_rgb(Image.open(io.BytesIO(data)))
    bucket = assign_bucket(*img.size)
    if bucket.status == "ok":
        shape = bucket.shape
        scale = max(shape.width / img.width, shape.height / img.height)
        cover = img.resize((math.ceil(img.width * scale), math.ceil(img.height * scale)),
                           Image.LANCZOS)
        x0, y0 = (cover.width - shape.width) // 2, (cover.height - shape.height) // 2
        encode_jpeg(cover.crop((x0, y0, x0 + shape.width, y0 + shape.height)))
        imagehash.phash(Image.open(io.BytesIO(data)))


def real_photos(n: int = 40) -> list[bytes]:
    rng = np.random.default_rng(21)
    photos = [Image.open(p) for p in real_photo_paths()]
    return [encode(photo_variant(rng, photos[i % len(photos)]), "JPEG", 90) for i in range(n)]


def generated(n: int = 12) -> list[bytes]:
    rng = np.random.default_rng(22)
    out = []
    for i in range(n):
        mp = 1 + 11 * i / max(1, n - 1)
        aspect = float(rng.uniform(0.6, 1.8))
        w, h = int(math.sqrt(mp * 1e6 * aspect)), int(math.sqrt(mp * 1e6 / aspect))
        out.append(encode(procedural_image(rng, w, h), "JPEG", 90))
    return out


def compare(label: str, images: list[bytes]) -> list[Figure]:
    naive_s, _ = timed(lambda: [naive(d) for d in images])
    ours_s, results = timed(lambda: [process_image(d) for d in images])
    ours_hash_s, _ = timed(lambda: [phash_mod.phash(Image.open(io.BytesIO(d))) for d in images])
    ref_hash_s, refs = timed(lambda: [str(imagehash.phash(Image.open(io.BytesIO(d)))) for d in images])
    hashed = [(r, ref) for r, ref in zip(results, refs) if r.phash is not None]
    agreement = sum(phash_mod.hash_hex(r.phash) == ref for r, ref in hashed) / max(1, len(hashed))
    psnrs = []
    for data, fast in zip(images, results):
        if fast.status == "ok":
            slow = process_image(data, EXACT)
            # 99 dB stands for "identical" (infinite PSNR) so the ratio stays printable.
            psnrs.append(min(99.0, psnr(_pixels(fast.image), _pixels(slow.image))))
    n = len(images)
    print(f"{label}: {n} images, phash bit agreement with imagehash {agreement:.1%} "
          f"({len(hashed)} hashed); shortcut PSNR vs exact path: min {min(psnrs):.1f} dB, "
          f"median {np.median(psnrs):.1f} dB")
    return [
        Figure("image", f"{label} images/s/core", n / ours_s, "naive decode+resize+imagehash",
               n / naive_s, "img/s"),
        Figure("phash", f"{label} hashes/s/core", n / ours_hash_s, "imagehash.phash",
               n / ref_hash_s, "hash/s"),
        Figure("phash", f"{label} bit agreement %", 100 * agreement, "imagehash (100%)", 100.0, "%"),
        Figure("image", f"{label} shortcut PSNR min", min(psnrs), "floor 45 dB", 45.0, "dB"),
    ]


def main() -> list[Figure]:
    figures = compare("real", real_photos()) + compare("gen1-12MP", generated())
    report(figures, "image_stage")
    return figures


def _pixels(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


if __name__ == "__main__":
    main()
