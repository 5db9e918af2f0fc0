"""A small but real demo corpus built locally: no downloads.

Real photos shipped by scikit-image (and matplotlib, when installed) plus procedurally
generated images of many sizes and aspect ratios, spread over an image folder, WebDataset
tars and a parquet file, with planted duplicates across sources and a few broken files.
"""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageDraw, ImageFilter

# Width x height choices: from thumbnails below the 384² floor to ~6 MP, aspect 0.33-3.
SIZES = [(320, 240), (512, 512), (640, 480), (480, 640), (800, 600), (1024, 768), (768, 1024),
         (1280, 720), (720, 1280), (1200, 1200), (1600, 900), (1000, 2000), (2000, 1000),
         (1920, 1280), (1536, 1536), (2400, 1600), (3000, 2000), (900, 2700), (2700, 900),
         (300, 300), (1100, 700), (700, 1100), (1400, 1050), (2048, 1536)]


def real_photo_paths() -> list[Path]:
    """Photos that installed packages ship (scikit-image's data folder, matplotlib's)."""
    found: list[Path] = []
    try:
        import skimage

        data = Path(skimage.__file__).parent / "data"
        names = ["astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "motorcycle_left.png",
                 "motorcycle_right.png", "hubble_deep_field.jpg", "retina.jpg", "brick.png",
                 "grass.png", "gravel.png", "camera.png", "coins.png", "moon.png", "ihc.png"]
        found += [data / n for n in names if (data / n).exists()]
    except ImportError:
        pass
    try:
        import matplotlib

        hopper = Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg"
        if hopper.exists():
            found.append(hopper)
    except ImportError:
        pass
    return found


def procedural_image(rng: np.random.Generator, width: int, height: int) -> Image.Image:
    """Smooth gradients, shapes and grain: compresses and hashes like a photo, not like noise.

    Drawn at a quarter of the size and upscaled (fast), then given full-resolution grain.
    """
    sw, sh = max(8, width // 4), max(8, height // 4)
    y, x = np.mgrid[0:sh, 0:sw].astype(np.float32)
    base = np.stack([
        (np.sin(x / rng.uniform(10, 100) + rng.uniform(0, 6)) * 0.5 + 0.5) * rng.uniform(60, 255),
        (np.cos(y / rng.uniform(10, 100) + rng.uniform(0, 6)) * 0.5 + 0.5) * rng.uniform(60, 255),
        ((x + y) / (sw + sh)) * rng.uniform(60, 255),
    ], axis=-1)
    img = Image.fromarray(base.clip(0, 255).astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(3, 12))):
        x0, y0 = rng.uniform(0, sw), rng.uniform(0, sh)
        x1, y1 = x0 + rng.uniform(5, sw / 2), y0 + rng.uniform(5, sh / 2)
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)((x0, y0, x1, y1), fill=colour)
    img = img.filter(ImageFilter.GaussianBlur(radius=float(rng.uniform(0.3, 1.0))))
    img = img.resize((width, height), Image.Resampling.BICUBIC)
    # Grain from `rng` (Pillow's `effect_noise` draws from C's rand: the same seed gave
    # other bytes on every call).
    sigma = float(rng.uniform(20, 40))
    noise = 128 + sigma * rng.standard_normal((height, width), dtype=np.float32)
    grain = Image.fromarray(noise.clip(0, 255).astype(np.uint8), "L").convert("RGB")
    return Image.blend(img, grain, 0.06)


def photo_variant(rng: np.random.Generator, photo: Image.Image) -> Image.Image:
    """A crop and rescale of a real photo, so the corpus holds many real-looking images."""
    photo = photo.convert("RGB")
    w, h = photo.size
    cw, ch = int(w * rng.uniform(0.6, 1.0)), int(h * rng.uniform(0.6, 1.0))
    x0, y0 = int(rng.uniform(0, w - cw + 1)), int(rng.uniform(0, h - ch + 1))
    scale = rng.uniform(0.8, 3.0)
    crop = photo.crop((x0, y0, x0 + cw, y0 + ch))
    return crop.resize((max(64, int(cw * scale)), max(64, int(ch * scale))),
                       Image.Resampling.LANCZOS)


def encode(img: Image.Image, fmt: str, quality: int = 90) -> bytes:
    buffer = io.BytesIO()
    if fmt == "JPEG":
        img.convert("RGB").save(buffer, "JPEG", quality=quality)
    elif fmt == "PNG":
        img.save(buffer, fmt, compress_level=1)  # speed over size: this is test data
    else:
        img.save(buffer, fmt, quality=quality, method=0)
    return buffer.getvalue()


@dataclass
class DemoItem:
    key: str
    data: bytes
    caption: str


# What each shipped photo shows, in the dense, literal style the captioner is asked for, so
# the demo's `original` captions read like real captions (and classify as visual).
PHOTO_CAPTIONS = {
    "astronaut": "An astronaut in a white spacesuit poses indoors beside an American flag, "
                 "holding a helmet, with a model of a spacecraft behind the left shoulder.",
    "chelsea": "A ginger tabby cat with pale green eyes sits close to the camera, its striped "
               "fur lit softly from the left against a blurred brown background.",
    "coffee": "A white cup of coffee with a light brown foam top rests on a white saucer with "
              "a silver spoon, on a red tablecloth seen from above.",
    "rocket": "A white rocket stands on a launch pad under a clear blue sky, with a steel "
              "service tower on its right and small clouds of vapour at its base.",
    "motorcycle_left": "A red and black motorcycle is parked in a garage, seen from the side, "
                       "with tools and shelves in the dim background.",
    "motorcycle_right": "A red and black motorcycle is parked in a garage, seen from the side, "
                        "with tools and shelves in the dim background.",
    "hubble_deep_field": "Hundreds of small galaxies in orange, white and blue shine against a "
                         "black sky, spirals and ellipses scattered across the frame.",
    "retina": "A close-up of a human retina in orange and red, with dark branching blood vessels "
              "spreading from a bright yellow disc on the left.",
    "brick": "A grey brick wall fills the frame, rows of rough rectangular bricks separated by "
             "lighter mortar lines under even daylight.",
    "grass": "Dense green grass blades fill the frame, lit from above, with darker shadows "
             "between the leaves.",
    "gravel": "A bed of small grey and brown pebbles fills the frame, seen from above in flat "
              "light.",
    "camera": "A black and white photograph of a man in a dark coat looking through a camera "
              "on a tripod, standing on grass with buildings far behind.",
    "coins": "A black and white photograph of old coins of several sizes laid in rows on a dark "
             "surface, their rims bright under the light.",
    "moon": "A black and white close-up of the cratered surface of the moon, grey plains and "
            "round craters lit from one side.",
    "ihc": "A microscope image of stained tissue, purple and brown cells packed in a pale "
           "pink background.",
    "grace_hopper": "A woman in a dark naval uniform with medals and a white collar poses for a "
                    "formal portrait in front of a plain grey background.",
}
SHAPE_WORDS = ["soft circles", "overlapping rectangles", "blurred blobs", "round spots"]
COLOUR_WORDS = ["red", "orange", "yellow", "green", "teal", "blue", "purple", "pink", "grey"]


def _caption(rng: np.random.Generator, photo: str | None) -> str:
    if photo:
        return PHOTO_CAPTIONS.get(photo, "A photograph of an everyday scene in daylight.")
    first, second = rng.choice(COLOUR_WORDS, size=2, replace=False)
    shapes = SHAPE_WORDS[int(rng.integers(len(SHAPE_WORDS)))]
    return (f"An abstract picture of smooth {first} and {second} gradients with {shapes} "
            f"scattered across it, slightly blurred, with a fine grain over the whole surface.")


Progress = Callable[[str], None]
PROGRESS_EVERY = 25  # images between two progress lines


def _quiet(line: str) -> None:
    """No progress lines (the default)."""


def generate_items(n: int, seed: int, prefix: str, progress: Progress = _quiet,
                   name: str = "") -> list[DemoItem]:
    rng = np.random.default_rng(seed)
    paths = real_photo_paths()
    photos, names = [Image.open(p) for p in paths], [p.stem for p in paths]
    items = []
    for i in range(n):
        if photos and i % 3 == 0:
            index = int(rng.integers(len(photos)))
            img, photo = photo_variant(rng, photos[index]), names[index]
        else:
            w, h = SIZES[int(rng.integers(len(SIZES)))]
            img, photo = procedural_image(rng, w, h), None
        fmt = ["JPEG", "JPEG", "JPEG", "PNG", "WEBP"][i % 5]
        if fmt == "PNG" and i % 10 == 3:
            img = img.convert("L") if i % 20 == 3 else img.convert("P")
        ext = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}[fmt]
        items.append(DemoItem(f"{prefix}{i:05d}.{ext}", encode(img, fmt), _caption(rng, photo)))
        if (i + 1) % PROGRESS_EVERY == 0 or i + 1 == n:
            progress(f"{name or prefix}: {i + 1} of {n} images drawn")
    return items


def broken_files() -> dict[str, bytes]:
    """Bad input the pipeline must record, not crash on."""
    good = encode(procedural_image(np.random.default_rng(7), 640, 480), "JPEG")
    gif = io.BytesIO()
    Image.new("RGB", (500, 500), "red").save(gif, "GIF")
    return {
        "broken/empty.jpg": b"",
        "broken/truncated.jpg": good[: len(good) // 2],
        "broken/not_an_image.jpg": b"this is a text file, not a JPEG\n" * 20,
        "broken/actually_gif.png": gif.getvalue(),
    }


def make_demo_corpus(root: Path, scale: int = 1, progress: Progress = _quiet) -> Path:
    """Write three sources under `root` and a sources.yaml describing them; returns its path.
    `progress` gets a short line every PROGRESS_EVERY images."""
    root = Path(root)
    folder, wds, parquet_dir = root / "folder", root / "wds", root / "parquet"
    for d in (folder, wds, parquet_dir):
        d.mkdir(parents=True, exist_ok=True)

    folder_items = generate_items(120 * scale, seed=1, prefix="img/", progress=progress,
                                  name="demo_folder")
    for item in folder_items:
        path = folder / item.key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(item.data)
        path.with_suffix(".txt").write_text(item.caption)
    for name, data in broken_files().items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)

    wds_items = generate_items(100 * scale, seed=2, prefix="s", progress=progress,
                               name="demo_wds")
    # Planted duplicates: exact copies and re-encoded, downsized copies of folder images.
    dup_sources = [it for it in folder_items if it.key.endswith(".jpg")][:12]
    for j, item in enumerate(dup_sources):
        if j % 2 == 0:
            wds_items.append(DemoItem(f"dup{j:03d}.jpg", item.data, item.caption))
        else:
            img = Image.open(io.BytesIO(item.data))
            small = img.resize((max(1, img.width * 3 // 4), max(1, img.height * 3 // 4)),
                               Image.Resampling.LANCZOS)
            wds_items.append(DemoItem(f"dup{j:03d}.jpg", encode(small, "JPEG", 85), item.caption))
    _write_tars(wds, wds_items, per_tar=40 * scale)

    parquet_items = generate_items(80 * scale, seed=3, prefix="p", progress=progress,
                                   name="demo_parquet")
    parquet_items += [DemoItem(f"pdup{j}", it.data, it.caption)
                      for j, it in enumerate(dup_sources[:4])]
    _write_parquet(parquet_dir / "part-0.parquet", parquet_items)

    sources = root / "sources.yaml"
    sources.write_text(
        "# Demo sources, generated by `prx-assets make-demo-corpus`.\n"
        "sources:\n"
        "  - {name: demo_folder, kind: image_folder, uri: folder, license: cc-by-4.0, "
        "weight: 1.0}\n"
        "  - {name: demo_wds, kind: webdataset, uri: wds, license: cc-by-4.0, weight: 2.0,\n"
        "     caption_extension: json, caption_field: caption}\n"
        "  - {name: demo_parquet, kind: parquet, uri: parquet, license: internal, weight: 1.0,\n"
        "     image_column: image, key_column: key, caption_column: caption}\n"
    )
    write_demo_subsets(root / "subsets.yaml")
    return sources


DEMO_SUBSET = "demo_photos"


def write_demo_subsets(path: Path) -> Path:
    """The demo's subsets.yaml (beside its sources.yaml): one fine-tuning subset."""
    path.write_text(
        "# Demo subsets, generated by `prx-assets make-demo-corpus`: one partition each of\n"
        "# the `subsets` asset, built into its own tree (`prx-assets mds-uri --subset NAME`).\n"
        "subsets:\n"
        f"  - name: {DEMO_SUBSET}\n"
        "    version: 1\n"
        "    description: visual photographs without dominant text or a watermark\n"
        "    labels: [visual]\n"
        "    attributes: {medium: [photo], visible_text: [none, some, unknown], "
        "watermark: false}\n"
        "    cap_per_source: 40\n"
        "    target_size: 80\n"
    )
    return path


def _write_tars(directory: Path, items: list[DemoItem], per_tar: int) -> None:
    for shard, start in enumerate(range(0, len(items), per_tar)):
        with tarfile.open(directory / f"shard-{shard:05d}.tar", "w") as tar:
            for item in items[start:start + per_tar]:
                stem, ext = item.key.rsplit(".", 1)
                _add_member(tar, f"{stem}.{ext}", item.data)
                _add_member(tar, f"{stem}.json", json.dumps({"caption": item.caption}).encode())
            if shard == 0:  # members that must never be extracted outside the target
                _add_member(tar, "../escape.jpg", items[0].data)
                _add_member(tar, "/abs/path.jpg", items[0].data)


def _add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def _write_parquet(path: Path, items: list[DemoItem]) -> None:
    table = pa.table({
        "key": [it.key for it in items],
        "image": pa.array([it.data for it in items], pa.binary()),
        "caption": [it.caption for it in items],
    })
    pq.write_table(table, path, row_group_size=32)
