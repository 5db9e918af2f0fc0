"""One decode per image: orient, convert to RGB, bucket-resize, encode Q92, and hash.

Colour rule (documented in docs/imaging.md): EXIF orientation is applied first; grey and
1-bit images are replicated to RGB; 16/32-bit grey is scaled to 8 bits by its own range
type (I;16 / 256); palette images go through RGBA when they carry transparency; any alpha
is composited on white; CMYK and YCbCr use Pillow's conversion. Animated images use their
first frame.
"""

from __future__ import annotations

import io
import math
import warnings
from dataclasses import dataclass

from PIL import Image, ImageOps

from prx_assets.stages.images import phash as phash_mod
from prx_assets.stages.images.buckets import Bucket, BucketRule, Shape, assign_bucket

DEFAULT_QUALITY = 92
# 4:4:4 (no chroma subsampling): chosen by measurement, see docs/imaging.md.
DEFAULT_SUBSAMPLING = "4:4:4"
_SUBSAMPLING = {"4:4:4": 0, "4:2:2": 1, "4:2:0": 2}
# EXIF orientations that swap width and height (90° and 270° rotations, transposes).
_SWAPPING_ORIENTATIONS = {5, 6, 7, 8}
STATUS_UNDECODABLE = "undecodable"
STATUS_TOO_MANY_PIXELS = "too_many_pixels"


@dataclass(frozen=True)
class ImageOptions:
    rule: BucketRule = BucketRule()
    quality: int = DEFAULT_QUALITY
    subsampling: str = DEFAULT_SUBSAMPLING
    resize_mode: str = "crop"  # "crop": cover then centre-crop; "stretch": ignore aspect
    # JPEG DCT-domain downscale: decode at no less than draft_margin x the needed size.
    # None disables draft (full decode).
    draft_margin: float | None = 2.0
    # Pillow's reduce-then-resample shortcut; None is the exact Lanczos.
    reducing_gap: float | None = 3.0
    max_pixels: int = 200_000_000


@dataclass
class ImageResult:
    status: str
    tier: int | None = None
    width: int | None = None
    height: int | None = None
    original_width: int | None = None
    original_height: int | None = None
    image: bytes | None = None
    phash: int | None = None
    flat: bool | None = None
    error: str | None = None


def oriented_size(image: Image.Image) -> tuple[int, int]:
    """Size after EXIF orientation, read from the header (no decode)."""
    w, h = image.size
    try:
        orientation = image.getexif().get(0x0112, 1)
    except Exception:
        orientation = 1
    return (h, w) if orientation in _SWAPPING_ORIENTATIONS else (w, h)


def to_rgb(image: Image.Image) -> Image.Image:
    """The documented colour rule: 8-bit RGB, alpha composited on white."""
    mode = image.mode
    if mode == "RGB":
        return image
    if mode in ("I;16", "I;16B", "I;16L", "I;16N"):
        return image.point(lambda v: v / 256).convert("L").convert("RGB")
    if mode in ("I", "F"):
        high = image.getextrema()[1]
        assert isinstance(high, (int, float))  # one band: (min, max), not a pair per band
        return image.convert("F").point(lambda v: v / 256).convert("L").convert("RGB") \
            if high > 255 else image.convert("L").convert("RGB")
    if mode == "P":
        image = image.convert("RGBA" if "transparency" in image.info else "RGB")
        mode = image.mode
    if mode in ("RGBA", "LA", "La", "RGBa", "PA"):
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def oriented_rgb(image: Image.Image) -> Image.Image:
    """EXIF orientation applied (a copy only when a rotation is needed), then `to_rgb`."""
    if image.getexif().get(0x0112, 1) != 1:
        image = ImageOps.exif_transpose(image)
    return to_rgb(image)


def cover_box(src_w: int, src_h: int, shape: Shape) -> tuple[float, float, float, float]:
    """The centred source region with the shape's aspect ratio (the crop of 'cover')."""
    target = shape.width / shape.height
    if src_w / src_h > target:  # too wide: trim the sides
        w = src_h * target
        x0 = (src_w - w) / 2
        return (x0, 0.0, x0 + w, float(src_h))
    h = src_w / target
    y0 = (src_h - h) / 2
    return (0.0, y0, float(src_w), y0 + h)


def draft_request(stored_w: int, stored_h: int, shape: Shape, margin: float,
                  swapped: bool) -> tuple[int, int]:
    """The decoded size to ask of JPEG draft: margin x what 'cover' needs, in stored axes."""
    tw, th = (shape.height, shape.width) if swapped else (shape.width, shape.height)
    scale = max(tw / stored_w, th / stored_h) * margin
    return (math.ceil(stored_w * min(1.0, scale)), math.ceil(stored_h * min(1.0, scale)))


def resize_to_shape(image: Image.Image, shape: Shape, options: ImageOptions) -> Image.Image:
    box = (None if options.resize_mode == "stretch"
           else cover_box(image.width, image.height, shape))
    return image.resize((shape.width, shape.height), Image.Resampling.LANCZOS, box=box,
                        reducing_gap=options.reducing_gap)


def encode_jpeg(image: Image.Image, quality: int = DEFAULT_QUALITY,
                subsampling: str = DEFAULT_SUBSAMPLING) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=quality, subsampling=_SUBSAMPLING[subsampling],
               optimize=False)
    return buffer.getvalue()


def process_image(data: bytes, options: ImageOptions = ImageOptions()) -> ImageResult:
    """Decode once and produce the bucketed JPEG and the phash, or the reason not to."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            image = Image.open(io.BytesIO(data))
            stored_w, stored_h = image.size
            if stored_w * stored_h > options.max_pixels:
                return ImageResult(STATUS_TOO_MANY_PIXELS, original_width=stored_w,
                                   original_height=stored_h, error="over the pixel cap")
            width, height = oriented_size(image)
            bucket = assign_bucket(width, height, options.rule)
            result = ImageResult(bucket.status, original_width=width, original_height=height)
            if bucket.status != "ok":
                return result  # filtered by size alone: never decoded
            return _decode_and_encode(image, bucket, result, options, (width, height) != image.size)
    except Exception as exc:
        return ImageResult(STATUS_UNDECODABLE, error=f"{type(exc).__name__}: {exc}"[:500])


def _decode_and_encode(image: Image.Image, bucket: Bucket, result: ImageResult,
                       options: ImageOptions, swapped: bool) -> ImageResult:
    shape = bucket.shape
    assert shape is not None, bucket.status  # called for "ok" buckets only, which have one
    if getattr(image, "is_animated", False):
        image.seek(0)
    if options.draft_margin is not None and image.format == "JPEG":
        request = draft_request(image.width, image.height, shape, options.draft_margin,
                                swapped)
        image.draft("RGB" if image.mode in ("RGB", "YCbCr", "CMYK") else image.mode, request)
    image.load()
    result.phash, result.flat = phash_mod.phash(image)  # pre-orientation, like imagehash
    resized = resize_to_shape(oriented_rgb(image), shape, options)
    result.tier, result.width, result.height = bucket.tier, shape.width, shape.height
    result.image = encode_jpeg(resized, options.quality, options.subsampling)
    return result
