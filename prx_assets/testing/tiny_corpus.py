"""A tiny real corpus for the browser tests: two image-folder sources of real photos with
hand-written captions, run through the whole graph (ingest to skip lists and the corpus
table) on a temporary Dagster instance, plus a second caption version beside the active one.

Planted: exact copies across sources (groups in `duplicates`: the same photo, and a
brightened one), a slightly cropped copy whose phash differs by two bits (a near
duplicate), and an image too small to keep.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
from PIL import Image, ImageEnhance

from prx_assets.demo.corpus import encode
from prx_assets.stages.captions.captions import CAPTIONS_SCHEMA
from prx_assets.stages.ingest.ids import sample_id
from prx_assets.storage.lance_tables import append_rows
from prx_assets.storage.layout import Storage
from prx_assets.storage.refs import TableRef
from prx_assets.testing.sources import folder_source, write_sources

SKIMAGE = Path(str(__import__("skimage").__file__)).parent / "data"
# source -> key -> (photo, caption); captions carry words the tests search for.
PHOTOS = {
    "web": {
        "astronaut.jpg": ("astronaut.png", "An astronaut in a white spacesuit stands before an "
                          "American flag, a model space shuttle on the left, soft studio light."),
        "cat.jpg": ("chelsea.png", "A ginger tabby cat lies on a wooden floor, looking to the "
                    "right, whiskers lit from the side."),
        "coffee.jpg": ("coffee.png", "A cup of coffee with latte art in a white porcelain cup "
                       "on a saucer, a spoon beside it, red background."),
        "rocket.jpg": ("rocket.jpg", "A rocket on its launch pad under a blue sky, service "
                       "tower at its side, clouds of vapour at the base."),
        "motorbike.jpg": ("motorcycle_left.png", "A red motorcycle parked in a garage, seen "
                          "from the left, chrome exhaust and black seat."),
    },
    "stock": {
        "spaceman.jpg": ("astronaut.png", "Portrait of a spacewalker in a suit, flag behind."),
        "coins.jpg": ("coins.png", "Grey coins of several sizes scattered on a dark cloth, "
                      "seen from above."),
        "coffee-bright.jpg": ("coffee.png", "A brighter photo of a latte in a porcelain cup."),
        "motorbike-crop.jpg": ("motorcycle_left.png", "A red motorbike in a garage, its "
                               "edges cropped by a few pixels."),
        "tiny.jpg": ("camera.png", "A small photo of a man with a camera on a tripod."),
    },
}
OLD_VERSION = "hand-v0"
# Where the runs' metadata links point (the browser need not be serving while they run).
BROWSER_URL = "http://127.0.0.1:8080"


def table_ref(root, name: str, source: str | None = None) -> TableRef:
    return Storage(str(root)).table(name, source)


@dataclass(frozen=True)
class TinyCorpus:
    root: Path
    data_root: Path
    sources_file: Path
    home: Path

    def id(self, source: str, key: str) -> str:
        return sample_id(source, key)


def _image(photo: str, key: str) -> bytes:
    img = Image.open(SKIMAGE / photo).convert("RGB")
    if key == "tiny.jpg":
        return encode(img.resize((200, 200), Image.Resampling.LANCZOS), "JPEG", 90)
    scale = 640 / max(img.size)
    size = (round(img.width * scale), round(img.height * scale))
    img = img.resize(size, Image.Resampling.LANCZOS)
    if key == "coffee-bright.jpg":
        img = ImageEnhance.Brightness(img).enhance(1.08)  # same phash: an exact duplicate
    if key == "motorbike-crop.jpg":
        img = img.crop((4, 4, img.width - 4, img.height - 4))  # phash 2 bits away
    return encode(img, "JPEG", 92)


def write_photo_sources(root: Path) -> Path:
    """The photos of every source under `root/sources/<source>`, and their sources file."""
    for source, items in PHOTOS.items():
        folder = root / "sources" / source
        folder.mkdir(parents=True, exist_ok=True)
        for key, (photo, caption) in items.items():
            (folder / key).write_bytes(_image(photo, key))
            (folder / key).with_suffix(".txt").write_text(caption)
    return write_sources(root / "sources.yaml",
                         [folder_source(s, root / "sources" / s) for s in PHOTOS])


def add_old_caption_version(data_root: Path, source: str) -> None:
    """Rows of an older caption version, as a previous captioner would have left them."""
    table = table_ref(data_root, "captions", source)
    now = datetime(2026, 1, 1, tzinfo=UTC)
    rows = [{"id": sample_id(source, key), "caption_version": OLD_VERSION,
             "caption": f"old caption: {photo.split('.')[0]}", "n_words": 3,
             "model": "human", "backend": "original", "status": "ok", "error": None,
             "created_at": now} for key, (photo, _) in PHOTOS[source].items()]
    append_rows(table, pa.Table.from_pylist(rows, schema=CAPTIONS_SCHEMA), CAPTIONS_SCHEMA)


@contextmanager
def environment(corpus: TinyCorpus) -> Iterator[None]:
    """DAGSTER_HOME, PRX_DATA_ROOT and PRX_SOURCES pointing at the tiny corpus, and
    PRX_BROWSER_URL set so metadata carries browser links; all restored after."""
    names = ("PRX_DATA_ROOT", "PRX_SOURCES", "DAGSTER_HOME", "PRX_BROWSER_URL")
    saved = {k: os.environ.get(k) for k in names}
    os.environ.update(PRX_DATA_ROOT=str(corpus.data_root), PRX_SOURCES=str(corpus.sources_file),
                      DAGSTER_HOME=str(corpus.home), PRX_BROWSER_URL=BROWSER_URL)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def build(root: Path) -> TinyCorpus:
    """The whole graph over the tiny sources, everything on disk under `root`."""
    from prx_assets.demo.runner import materialize_all
    from prx_assets.testing.fault_runs import open_instance, write_instance_config

    corpus = TinyCorpus(root, root / "data", write_photo_sources(root),
                        write_instance_config(root / "dagster_home"))
    with environment(corpus):
        runs = materialize_all(corpus.sources_file, instance=open_instance(corpus.home))
        failed = [r.source for r in runs if not r.success]
        if failed:
            raise RuntimeError(f"tiny corpus: runs failed: {failed}")
        add_old_caption_version(corpus.data_root, "web")
    return corpus


def run_job(corpus: TinyCorpus, job: str, partition: str | None = None) -> None:
    """One job of the graph in process on the tiny corpus' instance (as the demo runs it)."""
    from prx_assets.definitions import build_defs
    from prx_assets.testing.fault_runs import open_instance

    with environment(corpus):
        result = build_defs(corpus.sources_file).resolve_job_def(job).execute_in_process(
            partition_key=partition, instance=open_instance(corpus.home))
        assert result.success, f"{job} failed"


if __name__ == "__main__":
    import sys
    import time

    start = time.time()
    built = build(Path(sys.argv[1]))
    print(f"built {built} in {time.time() - start:.0f} s")
