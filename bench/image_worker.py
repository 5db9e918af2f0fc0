"""One long-lived process of the image bench, on one Pillow build.

`python -m bench.image_worker [STOCK_DIR]`: with STOCK_DIR, that stock Pillow goes first on
sys.path (the build `make install` keeps beside pillow-simd). Reads pickled commands from
stdin and answers each on stdout:
  ("photos", folder)      -> paths of the bench photos, written there once (stock Pillow)
  ("load", [paths])       -> build name and version
  ("time", (candidate, n)) -> CPU seconds of one pass of the candidate over n images
  ("outputs", candidate)  -> per image: (stored JPEG or None, phash hex or None)
  ("reference", None)     -> per image: (exact Lanczos bucket or None, imagehash.phash hex)
  ("split", n)            -> CPU seconds per kernel step over the first n images
Candidates: naive (decode, exact Lanczos, Q92 encode, imagehash.phash on a second decode),
kernel (`process_image`), decode (a bare full decode).
"""

from __future__ import annotations

import io
import pickle
import sys
import time
from pathlib import Path

if len(sys.argv) > 1:
    sys.path.insert(0, sys.argv[1])

import imagehash
import numpy as np
from PIL import Image

from prx_assets.demo.corpus import real_photo_paths
from prx_assets.stages.images import phash as phash_mod
from prx_assets.stages.images import pil_backend
from prx_assets.stages.images.buckets import assign_bucket
from prx_assets.stages.images.fidelity import lossless_bucket
from prx_assets.stages.images.imaging import (
    ImageOptions,
    encode_jpeg,
    oriented_rgb,
    oriented_size,
    process_image,
    resize_to_shape,
)

EXACT = ImageOptions(draft_margin=None, reducing_gap=None)
TARGET_MP = (1.5, 4.0, 8.0, 12.0, 17.0)


def photo_files(folder: Path) -> list[str]:
    """The shipped photos plus one rescaled copy of each, JPEG (camera-like Q90 4:2:0) and
    PNG in turn, at sizes cycling through TARGET_MP; written once, then reused."""
    folder.mkdir(parents=True, exist_ok=True)
    files = []
    for i, path in enumerate(real_photo_paths()):
        files.append(str(path))
        photo = Image.open(path)
        photo = photo.convert("RGB" if photo.mode not in ("L", "RGB") else photo.mode)
        for fmt in (("JPEG", "PNG")[i % 2],):
            mp = TARGET_MP[i % len(TARGET_MP)]
            out = folder / f"{path.stem}_{mp:g}mp.{fmt.lower()}"
            if not out.exists():
                zoom = (mp * 1e6 / (photo.width * photo.height)) ** 0.5
                size = (round(photo.width * zoom), round(photo.height * zoom))
                options = {"quality": 90} if fmt == "JPEG" else {"compress_level": 6}
                photo.resize(size, Image.LANCZOS).save(out, fmt, **options)
            files.append(str(out))
    return files


def naive(data: bytes) -> tuple[bytes | None, str | None]:
    """What a straightforward pipeline does: full decode, exact Lanczos (the same geometry as
    the kernel: cover, centred crop), Q92 4:4:4, then imagehash on a second decode."""
    image = Image.open(io.BytesIO(data))
    bucket = assign_bucket(*oriented_size(image))
    if bucket.status != "ok":
        return None, None
    jpeg = encode_jpeg(resize_to_shape(oriented_rgb(image), bucket.shape, EXACT))
    return jpeg, str(imagehash.phash(Image.open(io.BytesIO(data))))


def kernel(data: bytes) -> tuple[bytes | None, str | None]:
    result = process_image(data)
    return result.image, (None if result.phash is None else phash_mod.hash_hex(result.phash))


def decode(data: bytes) -> tuple[None, None]:
    Image.open(io.BytesIO(data)).load()
    return None, None


CANDIDATES = {"naive": naive, "kernel": kernel, "decode": decode}


def split(images: list[bytes]) -> dict[str, float]:
    """The kernel's steps timed one by one (the same calls `process_image` makes)."""
    steps = dict.fromkeys(("decode", "hash", "colour", "resize", "encode"), 0.0)

    def step(name, fn):
        start = time.process_time()
        out = fn()
        steps[name] += time.process_time() - start
        return out

    for data in images:
        image = Image.open(io.BytesIO(data))
        bucket = assign_bucket(*oriented_size(image))
        if bucket.status != "ok":
            continue
        step("decode", image.load)
        # Each lambda is called at once, inside `step`; the defaults bind this image's values.
        step("hash", lambda image=image: phash_mod.phash(image))
        rgb = step("colour", lambda image=image: oriented_rgb(image))
        resized = step("resize", lambda rgb=rgb, shape=bucket.shape:
                       resize_to_shape(rgb, shape, ImageOptions()))
        step("encode", lambda resized=resized: encode_jpeg(resized))
    return steps


def main() -> None:
    images: list[bytes] = []
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        try:
            command, arg = pickle.load(stdin)
        except EOFError:
            return
        if command == "photos":
            answer = photo_files(Path(arg))
        elif command == "load":
            images = [Path(p).read_bytes() for p in arg]
            backend = pil_backend.current()
            answer = (backend.name, backend.version)
        elif command == "time":
            fn, count = CANDIDATES[arg[0]], arg[1]
            start = time.process_time()
            for data in images[:count]:
                fn(data)
            answer = time.process_time() - start
        elif command == "outputs":
            answer = [CANDIDATES[arg](data) for data in images]
        elif command == "reference":
            answer = []
            for data in images:
                exact = None
                if assign_bucket(*oriented_size(Image.open(io.BytesIO(data)))).status == "ok":
                    exact = np.ascontiguousarray(lossless_bucket(data, ImageOptions()))
                answer.append((exact, str(imagehash.phash(Image.open(io.BytesIO(data))))))
        elif command == "split":
            answer = split(images[:arg])
        else:
            raise ValueError(f"unknown command {command!r}")
        pickle.dump(answer, stdout)
        stdout.flush()


if __name__ == "__main__":
    main()
