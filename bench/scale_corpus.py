"""The scale bench's generated corpus: N JPEGs with a realistic spread of sizes and shapes.

Megapixels are log-uniform over 0.1-12 MP. Real collections span thumbnails to 12 MP phone
photos with many more small images than large ones; log-uniform is the simplest spread
with that property, and it puts a comparable share into every tier (about 8 % below the
384² floor, ~29 % each in the 512, 1024 and 2048 tiers, ~5 % reaching 4096), so the bench
measures every tier's output bytes. Web-scraped sets skew smaller still (median ~0.5 MP), so
time per image from this mix is on the heavy side; bytes per pixel are on the light side
(procedural content compresses better than photos).

Aspect ratios: the common camera and screen shapes (4:3, 3:2, 16:9, 1:1 and their
portraits) plus a 10 % tail log-uniform between 1:3 and 3:1, so a few percent fall
outside the [0.5, 2] filter. One file in 500 is broken (truncated, empty, not an image).

Images come from `prx_assets.demo.corpus.procedural_image` (photo-like gradients, shapes and
grain; above 2 MP crops of a few large ones, see `picture`), JPEG quality 85-90, generated
once by a 2-process pool and cached under bench/out; each image's sidecar .txt is its
`original` caption (~35 words, alt-text length).
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

SEED = 20261130
MIN_MP, MAX_MP = 0.1, 12.0
COMMON_ASPECTS = {4 / 3: 0.24, 3 / 2: 0.18, 16 / 9: 0.12, 1.0: 0.10, 3 / 4: 0.10,
                  2 / 3: 0.10, 9 / 16: 0.06}  # + 0.10 tail
TAIL_SHARE = 0.10
TAIL_RANGE = (1 / 3, 3.0)
BROKEN_EVERY = 500
CROP_FROM_MP = 2.0  # larger pictures are crops of shared canvases (see `picture`)
CANVAS_SIDE = 6144
CANVASES = 4
COLOURS = ("red", "orange", "yellow", "green", "teal", "blue", "purple", "pink", "grey",
           "cream", "brown", "black", "white")
SHAPES = ("soft circles", "overlapping rectangles", "blurred blobs", "round spots",
          "rounded squares", "elongated ovals")
PLACES = ("in the upper left", "near the centre", "along the lower edge", "on the right side",
          "in the top right corner", "across the middle", "at the bottom left")


@dataclass(frozen=True)
class Planned:
    index: int
    width: int
    height: int
    quality: int
    broken: str | None  # None, "truncated", "empty" or "not_an_image"


def plan_image(index: int) -> Planned:
    """Deterministic per index: any subset of the corpus is the same images."""
    rng = np.random.default_rng((SEED, index))
    mp = math.exp(rng.uniform(math.log(MIN_MP), math.log(MAX_MP)))
    aspect = _aspect(rng)
    width = max(16, round(math.sqrt(mp * 1e6 * aspect)))
    height = max(16, round(math.sqrt(mp * 1e6 / aspect)))
    broken = None
    if index % BROKEN_EVERY == BROKEN_EVERY - 1:
        broken = ("truncated", "empty", "not_an_image")[(index // BROKEN_EVERY) % 3]
    return Planned(index, width, height, int(rng.integers(85, 91)), broken)


def _aspect(rng: np.random.Generator) -> float:
    if rng.random() < TAIL_SHARE:
        low, high = TAIL_RANGE
        return math.exp(rng.uniform(math.log(low), math.log(high)))
    ratios = list(COMMON_ASPECTS)
    weights = np.array(list(COMMON_ASPECTS.values()))
    return ratios[int(rng.choice(len(ratios), p=weights / weights.sum()))]


def caption_for(index: int) -> str:
    """A source caption of 25-40 words: alt-text length, what an `original` source ships
    (production captions of 100-200 words are costed from the labels bench instead)."""
    rng = np.random.default_rng((SEED, index, 1))
    first, second = rng.choice(COLOURS, size=2, replace=False)
    shapes, place = rng.choice(SHAPES), rng.choice(PLACES)
    return (f"An abstract picture: several {first} {shapes} sit {place}, their edges softened "
            f"by a faint blur against a smooth {second} gradient, with a fine even grain over "
            f"the whole surface and no text in the frame.")


def image_bytes(planned: Planned) -> bytes:
    from prx_assets.demo.corpus import encode

    if planned.broken == "empty":
        return b""
    if planned.broken == "not_an_image":
        return b"this is a text file saved with a .jpg name\n" * 10
    rng = np.random.default_rng((SEED, planned.index, 2))
    data = encode(picture(rng, planned.width, planned.height), "JPEG", planned.quality)
    return data[: len(data) // 2] if planned.broken == "truncated" else data


def picture(rng: np.random.Generator, width: int, height: int) -> Image.Image:
    """`procedural_image` at the planned size; large pictures are random crops (flipped at
    random) of a few big procedural canvases per process, since drawing costs ~0.1 s per
    megapixel and a crop almost nothing. Drawn at a quarter size and upscaled like the
    canvases, a crop has the same grain, gradients and edges per pixel as a picture drawn
    at its size, only its shapes are larger."""
    from prx_assets.demo.corpus import procedural_image

    if width * height < CROP_FROM_MP * 1e6 or max(width, height) > CANVAS_SIDE:
        return procedural_image(rng, width, height)
    canvas = _canvases()[int(rng.integers(CANVASES))]
    x0 = int(rng.integers(0, CANVAS_SIDE - width + 1))
    y0 = int(rng.integers(0, CANVAS_SIDE - height + 1))
    crop = canvas.crop((x0, y0, x0 + width, y0 + height))
    return crop.transpose(Image.FLIP_LEFT_RIGHT) if rng.random() < 0.5 else crop


_CANVAS_CACHE: list[Image.Image] = []


def _canvases() -> list[Image.Image]:
    from prx_assets.demo.corpus import procedural_image

    if not _CANVAS_CACHE:
        _CANVAS_CACHE.extend(procedural_image(np.random.default_rng((SEED, k, 3)), CANVAS_SIDE,
                                              CANVAS_SIDE) for k in range(CANVASES))
    return _CANVAS_CACHE


def image_path(corpus: Path, index: int) -> Path:
    return corpus / "images" / f"{index:06d}.jpg"


def _write_one(args: tuple[Path, int]) -> int:
    corpus, index = args
    path = image_path(corpus, index)
    if path.exists() and path.with_suffix(".txt").exists():
        return path.stat().st_size
    data = image_bytes(plan_image(index))
    # Written aside and renamed: a killed generation never leaves a half file that looks done.
    partial = path.with_suffix(".jpg.partial")
    partial.write_bytes(data)
    path.with_suffix(".txt").write_text(caption_for(index))
    os.replace(partial, path)
    return len(data)


def generated_count(corpus: Path) -> int:
    marker = corpus / "complete.json"
    return json.loads(marker.read_text()).get("images", 0) if marker.exists() else 0


def generate_corpus(corpus: Path, total: int, processes: int = 2) -> Path:
    """Generate (or finish generating) images 0..total-1 in `corpus/images`; reused when a
    previous generation reached `total`. Image i is the same whatever the total."""
    if generated_count(corpus) >= total:
        return corpus
    (corpus / "images").mkdir(parents=True, exist_ok=True)
    jobs = [(corpus, i) for i in range(total)]
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        sizes = pool.map(_write_one, jobs, chunksize=16)
    (corpus / "complete.json").write_text(json.dumps({"images": total, "seed": SEED,
                                                      "bytes": sum(sizes)}))
    return corpus


def link_subset(corpus: Path, folder: Path, count: int) -> Path:
    """A source folder holding images 0..count-1 (and their captions) as hard links."""
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    for index in range(count):
        image = image_path(corpus, index)
        for path in (image, image.with_suffix(".txt")):
            os.link(path, folder / path.name)
    return folder


def corpus_profile(total: int) -> dict:
    """What the plan puts in the corpus: megapixel and aspect shares, broken files."""
    plans = [plan_image(i) for i in range(total)]
    mp = np.array([p.width * p.height / 1e6 for p in plans])
    aspect = np.array([p.width / p.height for p in plans])
    return {
        "images": total,
        "mean_mp": float(mp.mean()), "median_mp": float(np.median(mp)),
        "below_floor": float((mp < 384 * 384 / 1e6).mean()),
        "aspect_outside_0.5_2": float(((aspect < 0.5) | (aspect > 2)).mean()),
        "broken": sum(p.broken is not None for p in plans),
    }


if __name__ == "__main__":
    import sys

    from bench.common import OUT

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 10_000
    print(corpus_profile(n))
    print(generate_corpus(OUT / "scale_corpus", n))
