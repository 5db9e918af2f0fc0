import hashlib
import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from prx_assets.demo.corpus import encode, photo_variant, procedural_image, real_photo_paths
from prx_assets.stages.images import phash as phash_mod
from prx_assets.stages.images import pil_backend
from prx_assets.stages.images.buckets import Shape
from prx_assets.stages.images.fidelity import psnr
from prx_assets.stages.images.imaging import (
    ImageOptions,
    cover_box,
    oriented_size,
    process_image,
    to_rgb,
)
from prx_assets.testing import stock_pillow
from prx_assets.testing.images import image_bytes, jpeg_bytes

GOLDEN = Path(__file__).parent / "data" / "stock_phashes.json"


def decode(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data))


def real_photo_jpegs(n: int, seed: int = 11) -> list[bytes]:
    rng = np.random.default_rng(seed)
    photos = [Image.open(p) for p in real_photo_paths()]
    assert len(photos) >= 10, "scikit-image sample photos are needed for these tests"
    return [encode(photo_variant(rng, photos[i % len(photos)]), "JPEG", 90) for i in range(n)]


def test_output_is_q92_jpeg_of_the_bucket_shape():
    result = process_image(jpeg_bytes(1920, 1080, 3))
    assert (result.status, result.tier, result.width, result.height) == ("ok", 1024, 1360, 768)
    out = decode(result.image)
    assert out.format == "JPEG" and out.size == (1360, 768) and out.mode == "RGB"
    # Quality 92's luma table starts with 3 (libjpeg scaling of the standard table).
    assert out.quantization[0][0] == 3
    assert (result.original_width, result.original_height) == (1920, 1080)


def test_phash_matches_stock_imagehash_on_real_photos_and_flags_flat_images():
    photos = real_photo_jpegs(40)
    results = [process_image(d) for d in photos]
    reference = stock_pillow.stock(photos)["phash"]
    hashed = [(r, ref) for r, ref in zip(results, reference, strict=True) if r.status == "ok"]
    assert len(hashed) >= 30
    assert [phash_mod.hash_hex(r.phash) for r, _ in hashed] == [ref for _, ref in hashed]
    flat = process_image(image_bytes(Image.new("RGB", (800, 800), (90, 90, 90)), "PNG"))
    assert flat.flat is True and results[0].flat is False


def test_phash_of_sample_photos_equals_golden_stock_hashes():
    """Hashes computed once with stock Pillow 13 + imagehash and committed: they hold on
    whichever Pillow build is loaded."""
    golden = json.loads(GOLDEN.read_text())["files"]
    checked = 0
    for path in real_photo_paths():
        data = path.read_bytes()
        entry = golden.get(path.name)
        if entry is None or entry["sha256"] != hashlib.sha256(data).hexdigest():
            continue  # a different scikit-image release ships other bytes
        value, _ = phash_mod.phash(decode(data))
        assert phash_mod.hash_hex(value) == entry["phash"], path.name
        checked += 1
    assert checked >= 10


def _pillow_coefficients(in_size: int, out_size: int) -> np.ndarray:
    """precompute_coeffs + normalize_coeffs_8bpc of stock Pillow's Resample.c, line by line
    in plain Python (libm's sin), for the Lanczos filter."""
    def lanczos(x):
        def sinc(v):
            return 1.0 if v == 0.0 else math.sin(v * math.pi) / (v * math.pi)
        return sinc(x) * sinc(x / 3) if -3.0 <= x < 3.0 else 0.0

    scale = filterscale = in_size / out_size
    filterscale = max(filterscale, 1.0)
    support = 3.0 * filterscale
    matrix = np.zeros((in_size, out_size))
    for xx in range(out_size):
        center = (xx + 0.5) * scale
        ss = 1.0 / filterscale
        xmin = max(int(center - support + 0.5), 0)
        xmax = min(int(center + support + 0.5), in_size) - xmin
        weights = [lanczos((x + xmin - center + 0.5) * ss) for x in range(xmax)]
        total = 0.0
        for w in weights:
            total += w
        for x, w in enumerate(weights):
            k = w / total if total != 0.0 else w
            matrix[x + xmin, xx] = int(-0.5 + k * (1 << 22)) if k < 0 else int(0.5 + k * (1 << 22))
    return matrix


@pytest.mark.parametrize("in_size", [33, 100, 384, 999, 3000, 4032])
def test_lanczos_weights_are_stock_pillows(in_size):
    assert np.array_equal(phash_mod.lanczos_matrix(in_size, 32), _pillow_coefficients(in_size, 32))


def test_grey_thumbnail_is_stock_pillows_bit_for_bit():
    """Every mode and shape class (wide, tall: stock Pillow 13 changes the pass order for
    tall images, square, upscales) against stock Pillow's convert("L") + Lanczos 32x32."""
    rng = np.random.default_rng(5)
    images = []
    for w, h in [(1200, 800), (340, 1700), (800, 1200), (33, 29), (2000, 2000), (64, 900)]:
        smooth = np.cumsum(rng.normal(0, 9, (h, w, 3)), axis=1) + rng.normal(0, 4, (h, w, 3))
        images.append(Image.fromarray(np.clip(smooth % 256, 0, 255).astype(np.uint8)))
    images.append(Image.fromarray(rng.integers(0, 256, (700, 500, 3), dtype=np.uint8)))
    base = images[0]
    images += [base.convert(m) for m in ("L", "P", "RGBA", "LA", "1")]
    encoded = [image_bytes(img, "PNG") for img in images]
    encoded += [image_bytes(base.convert(m), "TIFF") for m in ("CMYK", "I;16")]
    encoded += real_photo_jpegs(6, seed=8)
    reference = stock_pillow.stock(encoded)
    for data, thumb, ref_hash in zip(encoded, reference["thumb"], reference["phash"],
                                     strict=True):
        image = decode(data)
        assert np.array_equal(phash_mod.grey_thumbnail(image), thumb), image.mode
        assert phash_mod.hash_hex(phash_mod.phash(image)[0]) == ref_hash, image.mode


def test_both_pillow_builds_agree_within_the_fidelity_bound():
    """The kernel on the loaded build against the same kernel on stock Pillow: identical
    hashes, and the stored JPEGs within 0.2 dB of each other's PSNR against the exact
    Lanczos bucket (with stock Pillow loaded both sides are the same build)."""
    photos = real_photo_jpegs(10, seed=4) + [image_bytes(decode(p).convert("RGB"), "PNG")
                                             for p in real_photo_jpegs(3, seed=6)]
    reference = stock_pillow.stock(photos, kernel=True)
    compared = 0
    for data, stock_jpeg, exact, stock_hash in zip(photos, reference["image"],
                                                   reference["exact"], reference["phash"],
                                                   strict=True):
        ours = process_image(data)
        assert (ours.image is None) == (stock_jpeg is None)
        if ours.status != "ok":
            continue
        assert phash_mod.hash_hex(ours.phash) == stock_hash
        ours_db = psnr(exact, np.asarray(decode(ours.image)))
        stock_db = psnr(exact, np.asarray(decode(stock_jpeg)))
        assert abs(ours_db - stock_db) <= 0.2, (ours_db, stock_db)
        assert psnr(np.asarray(decode(stock_jpeg)), np.asarray(decode(ours.image))) >= 40
        compared += 1
    assert compared >= 8


def test_the_loaded_pillow_build_is_named():
    backend = pil_backend.current()
    assert backend.name in (pil_backend.STOCK, pil_backend.SIMD)
    assert backend.version == Image.__version__ and backend.missing_codecs == ()
    assert backend.describe().startswith(backend.name)
    assert backend.simd == ("post" in backend.version)  # pillow-simd's releases are .postN


def test_a_binary_no_install_record_matches_is_unknown(tmp_path):
    from PIL import _imaging

    copy = tmp_path / Path(_imaging.__file__).name
    copy.write_bytes(b"not the installed binary")
    assert pil_backend._owner(copy) == pil_backend.UNKNOWN
    assert pil_backend._owner(Path(_imaging.__file__)) == pil_backend.current().name


def test_exif_orientation_is_applied_before_bucketing():
    img = procedural_image(np.random.default_rng(1), 1200, 800)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90°: stored landscape, displayed portrait
    buffer = io.BytesIO()
    img.save(buffer, "JPEG", quality=90, exif=exif)
    assert oriented_size(decode(buffer.getvalue())) == (800, 1200)
    result = process_image(buffer.getvalue())
    assert result.height > result.width and result.original_width == 800


@pytest.mark.parametrize("mode", ["L", "P", "RGBA", "LA", "CMYK", "I;16", "1"])
def test_every_mode_becomes_rgb(mode):
    img = Image.new("RGB", (600, 500), (200, 30, 30)).convert(mode)
    fmt = "TIFF" if mode in ("CMYK", "I;16") else "PNG"
    if fmt == "TIFF":
        assert to_rgb(decode(image_bytes(img, fmt))).mode == "RGB"
    else:
        result = process_image(image_bytes(img, fmt))
        assert result.status == "ok" and decode(result.image).mode == "RGB"


def test_alpha_is_composited_on_white():
    transparent = Image.new("RGBA", (600, 600), (255, 0, 0, 0))
    result = process_image(image_bytes(transparent, "PNG"))
    assert decode(result.image).getpixel((300, 300)) == pytest.approx((255, 255, 255), abs=2)


def test_crop_takes_the_centre_and_stretch_keeps_everything():
    assert cover_box(2000, 1000, Shape(1024, 1024)) == (500.0, 0.0, 1500.0, 1000.0)
    img = Image.new("RGB", (1333, 1000), "black")  # 4:3 -> shape 1152x912 (1.26): sides trimmed
    img.paste((255, 255, 255), (0, 0, 20, 1000))  # a white band on the far left
    data = image_bytes(img, "PNG")
    cropped = decode(process_image(data).image)
    stretched = decode(process_image(data, ImageOptions(resize_mode="stretch")).image)
    assert cropped.getpixel((2, 100))[0] < 30  # band cropped away
    assert stretched.getpixel((2, 100))[0] > 225  # band kept when stretching


def test_bad_images_become_reasons():
    good = jpeg_bytes(800, 600, 4)
    assert process_image(good[: len(good) // 2]).status == "undecodable"
    assert process_image(b"not an image").status == "undecodable"
    assert process_image(jpeg_bytes(300, 300)).status == "too_small"
    assert process_image(jpeg_bytes(1200, 400)).status == "bad_aspect"
    assert process_image(good, ImageOptions(max_pixels=1000)).status == "too_many_pixels"


def test_animated_images_use_the_first_frame():
    frames = [Image.new("RGB", (600, 600), c) for c in ((0, 0, 255), (255, 0, 0))]
    buffer = io.BytesIO()
    frames[0].save(buffer, "WEBP", save_all=True, append_images=frames[1:], lossless=True)
    pixel = decode(process_image(buffer.getvalue()).image).getpixel((300, 300))
    assert pixel[2] > 200 and pixel[0] < 50


def test_shortcuts_stay_visually_identical_to_the_exact_path():
    exact = ImageOptions(draft_margin=None, reducing_gap=None)
    for data in [*real_photo_jpegs(8, seed=3), jpeg_bytes(4000, 3000, 9)]:
        fast, slow = process_image(data), process_image(data, exact)
        if fast.status == "ok":
            assert psnr(np.asarray(decode(fast.image)), np.asarray(decode(slow.image))) >= 40
