"""Shared fixtures: one embedded Ray for the session, a fresh data root per test, and
small real corpora built on disk (real photos from scikit-image plus generated images)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from PIL import Image

from prx_assets.testing.images import image_bytes, jpeg_bytes

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.pop("RAY_ADDRESS", None)  # tests start their own clusters where they need one
# Ray keeps as many idle workers as the node has CPUs (2 in the tests) and kills the rest a
# second after their task: a Ray Data join or shuffle then started a fresh worker process
# (seconds of imports) for nearly every task, ~10 s per tiny join. Six kept idle workers
# make them reused. Set before any Ray starts: the session's, and the subprocess runs' and
# test clusters' (they inherit this environment).
os.environ.setdefault("RAY_num_workers_soft_limit", "6")

# A test that uses one of these fixtures (itself or through another) gets the mark, so
# `make test-fast` leaves it out: the S3 server, a browser, the browser tests' corpus
# (`tiny`, built by running the whole graph), or the embedded Ray.
CANARY_CREDENTIAL = ("PRX_TEST_CANARY_API_KEY", "canary-credential-of-the-test-driver")
MARKS_BY_FIXTURE = {"s3_server": "s3", "chromium": "browser", "tiny": "e2e", "ray_session": "ray"}




def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for fixture, mark in MARKS_BY_FIXTURE.items():
            if fixture in getattr(item, "fixturenames", ()):
                item.add_marker(mark)


@pytest.fixture(scope="session")
def ray_session():
    from prx_assets.engine import ray_runtime

    # A credential the driver holds when Ray starts: its workers must not inherit it.
    os.environ.setdefault(*CANARY_CREDENTIAL)
    started = ray_runtime.connect(num_cpus=2)
    yield
    if started:
        ray_runtime.disconnect()


@pytest.fixture()
def fresh_shared_memory(tmp_path_factory: pytest.TempPathFactory):
    """mosaicml-streaming keeps shared memory between datasets of one process: a test that
    opens datasets starts and ends without a stale segment of another's (this worker's
    only: the other test workers' datasets are live)."""
    from prx_assets.testing.shared_memory import release_shared_memory

    release_shared_memory(tmp_path_factory.getbasetemp())
    yield
    release_shared_memory(tmp_path_factory.getbasetemp())  # collects first when it frees


# Folders whose tests build and open MDS trees: each of their tests gets `fresh_shared_memory`.
MDS_TEST_FOLDERS = ("stages/shards", "stages/subsets", "stages/rewrite")


@pytest.fixture(autouse=True)
def _fresh_shared_memory_for_mds_tests(request: pytest.FixtureRequest):
    folder = request.node.path.parent.relative_to(Path(__file__).parent).as_posix()
    if folder in MDS_TEST_FOLDERS:
        request.getfixturevalue("fresh_shared_memory")
    yield


@pytest.fixture()
def claimed_meanwhile(monkeypatch):
    """Another process creates the prefix this one chose, just before this one creates it
    (the interleaving two datasets starting at once can take); yields the prefixes it took."""
    from multiprocessing import shared_memory

    from streaming.base.shared import prefix as streaming_prefix

    taken: list[shared_memory.SharedMemory] = []
    prefixes: list[int] = []
    real = streaming_prefix.SharedMemory

    def create_after_the_other(name, create=True, size=0, auto_cleanup=True):
        if create and name.endswith("_locals") and not taken:
            taken.append(shared_memory.SharedMemory(name, create=True, size=8))
            prefixes.append(int(name.lstrip("/").split("_")[0]))
        return real(name, create, size, auto_cleanup)

    monkeypatch.setattr(streaming_prefix, "SharedMemory", create_after_the_other)
    yield prefixes
    for segment in taken:
        segment.close()
        segment.unlink()


@pytest.fixture()
def data_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "data"
    monkeypatch.setenv("PRX_DATA_ROOT", str(root))
    return root


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


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3-compatible server (SeaweedFS) on a free port of 127.0.0.1 for the session."""
    from prx_assets.testing.s3_server import TEST_BUCKET, start_seaweedfs

    server = start_seaweedfs(tmp_path_factory.mktemp("s3-server"))
    server.create_bucket(TEST_BUCKET)
    yield server
    server.stop()


@pytest.fixture()
def s3_root(s3_server, request, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh `s3://` data root per test, with the standard AWS variables pointing at the
    test server and PRX_DATA_ROOT set to it."""
    import re
    import uuid

    from prx_assets.testing.s3_server import TEST_BUCKET

    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    name = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower())[:60]
    root = f"s3://{TEST_BUCKET}/{name}-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("PRX_DATA_ROOT", root)
    return root
