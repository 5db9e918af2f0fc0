"""DCT perceptual hash, bit-compatible with `imagehash.phash` (hash_size=8, highfreq 4).

imagehash: grey, Lanczos to 32x32, 2D DCT-II (scipy.fftpack, unnormalised), keep the 8x8
low-frequency block, bit = coefficient > median of the block, bits row-major, first bit
most significant. Here the thumbnail is taken from an image that is already decoded, so
hashing costs no second decode.
"""

from __future__ import annotations

import numpy as np
import scipy.fftpack
from PIL import Image

HASH_SIZE = 8
THUMB_SIZE = HASH_SIZE * 4
# A thumbnail this uniform (grey-level std) has no structure: its hash means nothing.
FLAT_STD = 1.0


def grey_thumbnail(image: Image.Image) -> np.ndarray:
    return np.asarray(image.convert("L").resize((THUMB_SIZE, THUMB_SIZE), Image.LANCZOS),
                      dtype=np.float64)


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
