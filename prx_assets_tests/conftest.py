"""Shared fixtures: one embedded Ray for the session, a fresh data root per test, and
small real corpora built on disk (real photos from scikit-image plus generated images)."""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.pop("RAY_ADDRESS", None)  # tests start their own clusters where they need one


@pytest.fixture(scope="session")
def ray_session():
    from prx_assets.engine import ray_runtime

    started = ray_runtime.connect(num_cpus=2)
    yield
    if started:
        ray_runtime.disconnect()


@pytest.fixture()
def data_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "data"
    monkeypatch.setenv("PRX_DATA_ROOT", str(root))
    return root


def jpeg_bytes(width: int, height: int, seed: int = 0, quality: int = 90) -> bytes:
    from prx_assets.demo.corpus import encode, procedural_image

    return encode(procedural_image(np.random.default_rng(seed), width, height), "JPEG", quality)


def image_bytes(img: Image.Image, fmt: str, **kwargs) -> bytes:
    buffer = io.BytesIO()
    img.save(buffer, fmt, **kwargs)
    return buffer.getvalue()


@pytest.fixture()
def small_folder(tmp_path: Path) -> Path:
    """An image folder: nested JPEG/PNG/WebP files with captions, plus bad files."""
    root = tmp_path / "folder"
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "one.jpg").write_bytes(jpeg_bytes(640, 480, 1))
    (root / "a" / "one.txt").write_text("first caption")
    (root / "a" / "b" / "two.png").write_bytes(
        image_bytes(Image.new("RGB", (500, 400), "blue"), "PNG"))
    (root / "three.webp").write_bytes(image_bytes(Image.new("RGB", (300, 600), "red"), "WEBP"))
    (root / "empty.jpg").write_bytes(b"")
    (root / "notes.jpg").write_bytes(b"plain text pretending to be a jpeg\n" * 10)
    good = jpeg_bytes(800, 600, 2)
    (root / "cut.jpg").write_bytes(good[: len(good) // 2])
    (root / "anim.png").write_bytes(image_bytes(Image.new("RGB", (400, 400)), "GIF"))
    (root / "dangling.jpg").symlink_to(root / "does-not-exist.jpg")
    (root / "readme.md").write_text("not listed: wrong extension")
    return root


def write_sources(path: Path, entries: list[str]) -> Path:
    path.write_text("sources:\n" + "".join(f"  - {e}\n" for e in entries))
    return path
