import io

import imagehash
import numpy as np
import pytest
from PIL import Image

from prx_assets.s2_images import phash as phash_mod
from prx_assets.s2_images.fidelity import psnr
from prx_assets.s2_images.imaging import (
    ImageOptions, cover_box, oriented_size, process_image, to_rgb)
from prx_assets.s2_images.buckets import Shape
from prx_assets.demo.corpus import encode, photo_variant, procedural_image, real_photo_paths
from prx_assets_tests.conftest import image_bytes, jpeg_bytes


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


def test_phash_matches_imagehash_on_real_photos_and_flags_flat_images():
    photos = real_photo_jpegs(40)
    agree = 0
    for data in photos:
        result = process_image(data)
        if result.status == "ok":
            agree += phash_mod.hash_hex(result.phash) == str(imagehash.phash(decode(data)))
    hashed = sum(process_image(d).status == "ok" for d in photos)
    assert hashed >= 30 and agree / hashed >= 0.99
    flat = process_image(image_bytes(Image.new("RGB", (800, 800), (90, 90, 90)), "PNG"))
    assert flat.flat is True and process_image(photos[0]).flat is False


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
    for data in real_photo_jpegs(8, seed=3) + [jpeg_bytes(4000, 3000, 9)]:
        fast, slow = process_image(data), process_image(data, exact)
        if fast.status == "ok":
            assert psnr(np.asarray(decode(fast.image)), np.asarray(decode(slow.image))) >= 40
