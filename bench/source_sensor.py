"""The source sensor's tick against a bare listing of the same source.

A tick is `stages.ingest.watch.listing_digest`: the walk ingest itself uses (sorted per
folder, a signature per file, caption siblings looked up) with one hash update per unit.
The baseline is the least any change check must do without an event feed: a recursive
`os.scandir` walk that stats every file (name, size, mtime), nothing sorted or hashed.
Both run over the same 100,000 small files in 100 folders (`PRX_SENSOR_OBJECTS` to change
the count), each timed twice and the faster kept, the page cache warm for both.

On the S3 test server (SeaweedFS on 127.0.0.1) the baseline is a bare paginated
`list_objects_v2` of the prefix (every key, size and ETag, nothing else), against the
sensor's tick over the same objects (`PRX_SENSOR_S3_OBJECTS`, default 20,000: uploading
100,000 objects one request each takes longer than the rest of the bench).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from bench.common import Figure, report, timed
from prx_assets.stages.ingest.sources import SourceSpec
from prx_assets.stages.ingest.watch import listing_digest

OBJECTS = int(os.environ.get("PRX_SENSOR_OBJECTS", "100000"))
S3_OBJECTS = int(os.environ.get("PRX_SENSOR_S3_OBJECTS", "20000"))
BUCKET = "sensor-bench"
FOLDERS = 100


def make_source(root: Path, count: int) -> Path:
    """`count` tiny `.jpg` files spread over FOLDERS sub-folders (content is not read)."""
    for i in range(count):
        folder = root / f"f{i % FOLDERS:03d}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{i:07d}.jpg").write_bytes(b"x")
    return root


def bare_listing(directory: Path) -> int:
    """Files under `directory`, each stat'ed: the floor of any listing-based check."""
    files = 0
    with os.scandir(directory) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                files += bare_listing(Path(entry.path))
            else:
                entry.stat()
                files += 1
    return files


def best_of_two(fn) -> tuple[float, object]:
    first, result = timed(fn)
    second, _ = timed(fn)
    return min(first, second), result


def measure(root: Path, count: int) -> list[Figure]:
    source = make_source(root / "source", count)
    spec = SourceSpec(name="bench", kind="image_folder", uri=str(source))
    bare_s, listed = best_of_two(lambda: bare_listing(source))
    tick_s, digest = best_of_two(lambda: listing_digest(spec, source))
    assert listed == count and digest.units == count, (listed, digest)
    return [Figure("sensor", f"tick, {count:,} local files", tick_s * 1000, "bare listing",
                   bare_s * 1000, "ms")]


def upload(client, count: int) -> None:
    """`count` one-byte `.jpg` objects over FOLDERS prefixes, a few uploads in flight."""
    from concurrent.futures import ThreadPoolExecutor

    def put(i: int) -> None:
        client.put_object(Bucket=BUCKET, Key=f"source/f{i % FOLDERS:03d}/{i:07d}.jpg",
                          Body=b"x")

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(put, range(count)))


def bare_object_listing(client) -> int:
    """Keys under the prefix, page by page: the floor of any listing-based check on S3."""
    keys = 0
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET,
                                                                 Prefix="source/"):
        keys += len(page.get("Contents", []))
    return keys


def measure_s3(work: Path, count: int) -> list[Figure]:
    from prx_assets.testing.s3_server import start_seaweedfs

    server = start_seaweedfs(work / "server")
    saved = dict(os.environ)
    try:
        os.environ.update(server.env())
        server.create_bucket(BUCKET)
        client = server.client()
        upload(client, count)
        spec = SourceSpec(name="bench", kind="image_folder", uri=f"s3://{BUCKET}/source")
        bare_s, listed = best_of_two(lambda: bare_object_listing(client))
        tick_s, digest = best_of_two(lambda: listing_digest(spec, spec.uri))
        assert listed == count and digest.units == count, (listed, digest)
    finally:
        server.stop()
        os.environ.clear()
        os.environ.update(saved)
    return [Figure("sensor", f"tick, {count:,} objects on the S3 test server",
                   tick_s * 1000, "bare list_objects_v2", bare_s * 1000, "ms")]


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="prx-sensor-bench-") as tmp:
        figures = measure(Path(tmp), OBJECTS)
        if S3_OBJECTS > 0:
            figures += measure_s3(Path(tmp), S3_OBJECTS)
        report(figures, "source_sensor")


if __name__ == "__main__":
    main()
