"""Image bytes for tests: a procedural JPEG of a given size, any Pillow image encoded."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def jpeg_bytes(width: int, height: int, seed: int = 0, quality: int = 90) -> bytes:
    from prx_assets.demo.corpus import encode, procedural_image

    return encode(procedural_image(np.random.default_rng(seed), width, height), "JPEG", quality)


def image_bytes(img: Image.Image, fmt: str, **kwargs) -> bytes:
    buffer = io.BytesIO()
    img.save(buffer, fmt, **kwargs)
    return buffer.getvalue()
