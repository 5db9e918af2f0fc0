"""DCT perceptual hash, bit-compatible with `imagehash.phash` (hash_size=8, highfreq 4) as
computed with stock Pillow.

imagehash: grey, Lanczos to 32x32, 2D DCT-II (scipy.fftpack, unnormalised), keep the 8x8
low-frequency block, bit = coefficient > median of the block, bits row-major, first bit
most significant. Here the thumbnail is taken from an image that is already decoded, so
hashing costs no second decode.

The grey conversion and the 32x32 Lanczos are re-implemented in numpy, integer for integer
as stock Pillow computes them (ITU-R 601 luma with 16-bit fixed-point weights; Pillow's
Lanczos support, coefficient rounding to 22 fractional bits, horizontal then vertical pass,
each rounded and clipped to 8 bits, in stock Pillow 13's pass order). pillow-simd's versions
of both differ by one grey level here and there, which flips hash bits; with this thumbnail
the hash is the same whichever Pillow build is loaded. The sums are exact in float64 (at most
~2^40), so BLAS does them.
"""

from __future__ import annotations

import itertools
import math
from functools import lru_cache

import numpy as np
import scipy.fftpack
from PIL import Image

HASH_SIZE = 8
THUMB_SIZE = HASH_SIZE * 4
# A thumbnail this uniform (grey-level std) has no structure: its hash means nothing.
FLAT_STD = 1.0

# Stock Pillow's fixed point (libImaging/Resample.c and Convert.c).
_PRECISION_BITS = 32 - 8 - 2
_LANCZOS_SUPPORT = 3.0
# ITU-R 601-2 luma weights as stock Pillow has them (x 65536, adding up to 65536).
_LUMA_MATRIX = (19595 / 65536, 38470 / 65536, 7471 / 65536, 0.0)
_ROWS_PER_BAND = 64  # float64 bands of ~64 rows stay in cache
_WEIGHT_GROUPS = 4  # measured: 42 -> 28 ms for a 17 MP horizontal pass (2 and 8: 31 ms)


def _lanczos(x: np.ndarray) -> np.ndarray:
    """Pillow's truncated sinc: sinc(x) * sinc(x / 3) on [-3, 3), with sinc(0) = 1."""
    with np.errstate(divide="ignore", invalid="ignore"):
        px, px3 = x * math.pi, (x / 3) * math.pi
        s = np.where(x == 0.0, 1.0, np.sin(px) / px)
        s3 = np.where(x == 0.0, 1.0, np.sin(px3) / px3)
    return np.where((x >= -_LANCZOS_SUPPORT) & (x < _LANCZOS_SUPPORT), s * s3, 0.0)


@lru_cache(maxsize=256)
def lanczos_matrix(in_size: int, out_size: int) -> np.ndarray:
    """(in_size, out_size) matrix of Pillow's integer Lanczos weights (as float64) for a
    resize of the whole axis: column j holds output pixel j's weights."""
    scale = in_size / out_size
    filterscale = max(scale, 1.0)
    support = _LANCZOS_SUPPORT * filterscale
    centers = (np.arange(out_size) + 0.5) * scale
    # C casts truncate toward zero; the clamps follow.
    xmin = np.maximum(np.trunc(centers - support + 0.5), 0).astype(np.int64)
    xmax = np.minimum(np.trunc(centers + support + 0.5), in_size).astype(np.int64) - xmin
    ksize = int(xmax.max())
    offsets = np.arange(ksize)
    valid = offsets[None, :] < xmax[:, None]
    taps = (offsets[None, :] + xmin[:, None] - centers[:, None] + 0.5) * (1.0 / filterscale)
    weights = np.where(valid, _lanczos(taps), 0.0)
    # Pillow adds the weights left to right; cumsum keeps that order (np.sum would not).
    totals = np.cumsum(weights, axis=1)[:, -1]
    weights = np.where(totals[:, None] != 0.0, weights / totals[:, None], weights)
    fixed = weights * (1 << _PRECISION_BITS)
    fixed = np.trunc(np.where(fixed < 0, fixed - 0.5, fixed + 0.5))
    matrix = np.zeros((in_size, out_size))
    rows = offsets[None, :] + xmin[:, None]
    cols = np.broadcast_to(np.arange(out_size)[:, None], rows.shape)
    matrix[rows[valid], cols[valid]] = fixed[valid]
    matrix.setflags(write=False)
    return matrix


def _clip8(sums: np.ndarray) -> np.ndarray:
    """Pillow's rounding of a fixed-point sum back to 8 bits (clip8 in Resample.c)."""
    rounded = np.floor((sums + (1 << (_PRECISION_BITS - 1))) / (1 << _PRECISION_BITS))
    return np.clip(rounded, 0, 255)


def grey_pixels(image: Image.Image) -> np.ndarray:
    """The image as stock Pillow's `convert("L")` gives it, as a (h, w) uint8 array."""
    mode = image.mode
    if mode == "L":
        return np.asarray(image)
    if mode in ("LA", "La"):
        return np.asarray(image.getchannel(0))
    if mode in ("P", "RGBA", "RGBX", "CMYK"):
        # Stock Pillow converts palette entries, RGBA (ignoring alpha) and CMYK (through its
        # RGB) with the same luma formula as RGB; pillow-simd's CMYK to L differs.
        image, mode = image.convert("RGB"), "RGB"
    if mode == "RGB":
        # Pillow's matrix conversion is plain C float arithmetic that pillow-simd leaves
        # alone; with these weights every step is exact (each partial sum fits float32's
        # 24 bits), so it equals stock's integer (sum + 0x8000) >> 16, and it is faster
        # than the same formula in numpy.
        return np.asarray(image.convert("L", matrix=_LUMA_MATRIX))
    # Other modes (1, I, I;16, F, YCbCr, HSV, RGBa) go through converters that
    # pillow-simd leaves as stock Pillow has them.
    return np.asarray(image.convert("L"))


@lru_cache(maxsize=256)
def _weight_groups(in_size: int, out_size: int
                   ) -> tuple[tuple[int, int, int, int, np.ndarray], ...]:
    """The weight matrix cut into column groups, each with the input span its weights cover:
    a downscale's matrix is mostly zeros, and skipping them saves a third of the products."""
    matrix = lanczos_matrix(in_size, out_size)
    used = matrix != 0
    groups = []
    bounds = np.linspace(0, out_size, min(_WEIGHT_GROUPS, out_size) + 1).astype(int)
    for first, last in itertools.pairwise(bounds):
        rows = np.flatnonzero(used[:, first:last].any(axis=1))
        lo, hi = (int(rows[0]), int(rows[-1]) + 1) if len(rows) else (0, 1)
        groups.append((lo, hi, int(first), int(last),
                       np.ascontiguousarray(matrix[lo:hi, first:last])))
    return tuple(groups)


def _horizontal(grey: np.ndarray, out_size: int) -> np.ndarray:
    """Rows times the weight matrix, in bands of rows: converting the whole image to float64
    at once would cost more (memory traffic) than the products."""
    height, width = grey.shape
    groups = _weight_groups(width, out_size)
    out = np.empty((height, out_size))
    band = np.empty((min(_ROWS_PER_BAND, height), width))
    for top in range(0, height, _ROWS_PER_BAND):
        rows = band[:min(_ROWS_PER_BAND, height - top)]
        np.copyto(rows, grey[top:top + len(rows)])
        for lo, hi, first, last, weights in groups:
            out[top:top + len(rows), first:last] = rows[:, lo:hi] @ weights
    return _clip8(out)


def _vertical(grey: np.ndarray, out_size: int) -> np.ndarray:
    """The weight matrix (transposed) times columns, in bands of columns."""
    height, width = grey.shape
    groups = _weight_groups(height, out_size)
    out = np.empty((out_size, width))
    band = np.empty((height, min(_ROWS_PER_BAND, width)))
    for left in range(0, width, _ROWS_PER_BAND):
        cols = band[:, :min(_ROWS_PER_BAND, width - left)]
        np.copyto(cols, grey[:, left:left + cols.shape[1]])
        for lo, hi, first, last, weights in groups:
            out[first:last, left:left + cols.shape[1]] = weights.T @ cols[lo:hi]
    return _clip8(out)


def resize_lanczos(grey: np.ndarray, width: int, height: int) -> np.ndarray:
    """Stock Pillow's `resize((width, height), LANCZOS)` of an 8-bit grey image (whole-image
    box, no reducing_gap), as float64 grey levels."""
    out = np.asarray(grey)
    in_h, in_w = out.shape
    # Stock Pillow (13 on) runs the vertical pass first when the height shrinks by more than
    # twice as many pixels as the width; the order changes the rounding, so it is followed.
    vertical_first = in_h - height > 0 and in_h - height > (in_w - width) * 2
    for axis in ((0, 1) if vertical_first else (1, 0)):
        if axis == 1 and in_w != width:  # Pillow skips a pass whose size does not change
            out = _horizontal(out, width)
        elif axis == 0 and in_h != height:
            out = _vertical(out, height)
    return np.asarray(out, dtype=np.float64)


def grey_thumbnail(image: Image.Image) -> np.ndarray:
    return resize_lanczos(grey_pixels(image), THUMB_SIZE, THUMB_SIZE)


def phash_bits(thumbnail: np.ndarray) -> np.ndarray:
    dct = scipy.fftpack.dct(scipy.fftpack.dct(thumbnail, axis=0), axis=1)
    low = dct[:HASH_SIZE, :HASH_SIZE]
    return (low > np.median(low)).flatten()


def bits_to_int(bits: np.ndarray) -> int:
    """Row-major bits, first bit most significant (imagehash's hex order), as uint64."""
    value = 0
    for bit in bits:
        value = (value << 1) | int(bit)
    return value


def to_signed64(value: int) -> int:
    """Store as int64 (Arrow/Lance friendly); the bit pattern is what matters."""
    return value - (1 << 64) if value >= 1 << 63 else value


def phash(image: Image.Image) -> tuple[int, bool]:
    """(hash as a signed 64-bit int, flat) for a decoded image."""
    thumb = grey_thumbnail(image)
    return to_signed64(bits_to_int(phash_bits(thumb))), bool(thumb.std() < FLAT_STD)


def hash_hex(value: int) -> str:
    """The same 16 hex digits `str(imagehash.phash(img))` prints."""
    return f"{value & 0xFFFFFFFFFFFFFFFF:016x}"
