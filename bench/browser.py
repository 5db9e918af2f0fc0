"""Corpus browser: server time of its views on a generated 100,000-row corpus, against the
bare Lance queries behind each view, and the time to the first thumbnail in headless Chromium.

The generated data root holds every table the views read, at the design's paths: `corpus`
(captions, labels, phashes, embeddings, 256 px JPEG thumbnails, the full-text and bitmap
indexes; no vector index: the views timed here do not use it), and per source
`bucketed_images`, `raw_images`, `captions` (two versions), `caption_labels`, `mds_samples`
with skip sidecars beside empty shards, plus `duplicates` (10 % copies) and `opt_outs`.

Server time is the median wall time of an HTTP GET against the app served by uvicorn on
127.0.0.1 (what a browser waits for); the baseline runs the same Lance calls the view makes
per request, on the same opened datasets, with nothing else. The target is <= 1.5x.
`PRX_BROWSER_BENCH_ROWS` sets the size (default 100,000).
"""

from __future__ import annotations

import http.client
import io
import json
import os
import shutil
import statistics
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import lance
import numpy as np
import pyarrow as pa

from bench.common import Figure, report, timed
from prx_assets.browser import queries
from prx_assets.browser.catalog import Catalog
from prx_assets.browser.facets import FACET_COLUMNS
from prx_assets.models.embeddings import EMBEDDING_DIM
from prx_assets.stages.captions.captions import CAPTIONS_SCHEMA
from prx_assets.stages.corpus.corpus import CORPUS_SCHEMA
from prx_assets.stages.dedup.dedup import DUPLICATES_SCHEMA
from prx_assets.stages.images.imaging import ImageOptions
from prx_assets.stages.images.stage import BUCKETED_SCHEMA, settings_fingerprint
from prx_assets.stages.ingest.raw_rows import RAW_IMAGES_SCHEMA
from prx_assets.stages.labels.labels import LABELS_SCHEMA
from prx_assets.stages.opt_outs.opt_outs import AUDIT_SCHEMA
from prx_assets.stages.shards.mapping import MDS_SAMPLES_SCHEMA
from prx_assets.storage.layout import Storage
from prx_assets.storage.refs import TableRef

ROWS = int(os.environ.get("PRX_BROWSER_BENCH_ROWS", "100000"))
SOURCES = ("alpha", "beta")
SHAPES = ((512, 512), (576, 448), (448, 576), (640, 384))
WORDS = [
    "red", "blue", "green", "wooden", "metal", "glass", "cat", "dog", "bicycle", "street",
    "window", "lamp", "table", "chair", "mountain", "river", "cloud", "portrait", "city", "night",
    "light", "shadow", "stone", "tree", "flower", "car", "boat", "bridge", "sign", "poster",
    "screen", "kitchen", "garden", "beach", "snow", "desert", "forest",
]
SAMPLES_PER_SHARD = 2048
REPEATS = 15


# The image stage's own settings digest: these rows read as made under the defaults.
BENCH_SETTINGS = settings_fingerprint(ImageOptions())


def table_ref(root, name: str, source: str | None = None) -> TableRef:
    return Storage(str(root)).table(name, source)


def _thumbnails(rng: np.random.Generator, n: int = 64) -> list[bytes]:
    """Distinct 256 px JPEGs (q85, as the corpus stores them), reused across rows."""
    from prx_assets.demo.corpus import procedural_image

    out = []
    for i in range(n):
        img = procedural_image(rng, 256, 192 + (i % 3) * 32)
        buffer = io.BytesIO()
        img.save(buffer, "JPEG", quality=85)
        out.append(buffer.getvalue())
    return out


def _write(target: TableRef, table: pa.Table) -> None:
    Path(target.uri).parent.mkdir(parents=True, exist_ok=True)
    lance.write_dataset(table, target.uri, mode="overwrite", max_rows_per_file=1 << 20)


def generate(root: Path, rows: int = ROWS, seed: int = 0) -> dict:
    """Every table the browser reads, `rows` corpus rows over two sources."""
    rng = np.random.default_rng(seed)
    thumbs = _thumbnails(rng)
    source = np.array(SOURCES)[np.arange(rows) % len(SOURCES)]
    ids = [f"{s}:{i:024x}" for i, s in enumerate(source)]
    shape = np.arange(rows) % len(SHAPES)
    widths = np.array([w for w, _ in SHAPES], np.int32)[shape]
    heights = np.array([h for _, h in SHAPES], np.int32)[shape]
    words = np.array(WORDS)
    captions = [" ".join(words[rng.integers(0, len(words), 40)]) for _ in range(rows)]
    labels = np.array(["visual"] * 18 + ["text", "nsfw"])[np.arange(rows) % 20]
    phash = rng.integers(-(1 << 62), 1 << 62, rows, dtype=np.int64)
    copies = np.arange(rows) % 10 == 9  # 10 %: copies of the row before them
    phash[copies] = phash[np.flatnonzero(copies) - 1]
    vectors = rng.normal(size=(rows, EMBEDDING_DIM)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    thumb = [thumbs[i % len(thumbs)] for i in range(rows)]
    columns = {
        "id": ids, "source": source, "tier": pa.array(np.full(rows, 512, np.int32)),
        "width": widths, "height": heights, "caption": captions, "label": labels,
        "phash": phash,
        "embedding": pa.FixedSizeListArray.from_arrays(pa.array(vectors.ravel()), EMBEDDING_DIM),
        "thumbnail": pa.array(thumb, pa.binary()),
    }
    # The corpus columns the browser does not time (attributes, made_from) are left null.
    corpus = pa.table({field.name: columns.get(field.name, pa.nulls(rows, field.type))
                       for field in CORPUS_SCHEMA}).cast(CORPUS_SCHEMA)
    _write(table_ref(root, "corpus"), corpus)
    # The corpus asset's scalar and full-text indexes; its IVF_PQ index (minutes to train on
    # 100k rows) serves only more-like-this, which is not timed here.
    table = table_ref(root, "corpus").open()
    table.create_scalar_index("caption", index_type="INVERTED", replace=True)
    for column in ("source", "label", "tier"):
        table.create_scalar_index(column, index_type="BITMAP", replace=True)
    now = datetime(2026, 1, 1, tzinfo=UTC)
    for name in SOURCES:
        mine = np.flatnonzero(source == name)
        my_ids = [ids[i] for i in mine]
        n = len(mine)
        _write(table_ref(root, "bucketed_images", name), pa.table({
            "id": my_ids, "source": [name] * n, "status": ["ok"] * n,
            "tier": np.full(n, 512, np.int32), "width": widths[mine], "height": heights[mine],
            "original_width": widths[mine] * 2, "original_height": heights[mine] * 2,
            "image": pa.array([thumb[i] for i in mine], pa.large_binary()),
            "error": pa.nulls(n, pa.string()), "phash": phash[mine],
            "pixels": (widths[mine] * heights[mine] * 4).astype(np.int64),
            "flat": np.zeros(n, bool), "raw_sha256": [f"{i:064x}" for i in mine],
            "settings": [BENCH_SETTINGS] * n}).cast(BUCKETED_SCHEMA))
        _write(table_ref(root, "raw_images", name), pa.table({
            "id": my_ids, "source": [name] * n, "source_key": [f"img/{i}.jpg" for i in mine],
            "image": pa.array([thumb[i] for i in mine], pa.large_binary()),
            "format": ["JPEG"] * n, "width": widths[mine] * 2, "height": heights[mine] * 2,
            "n_bytes": np.full(n, 200_000, np.int64), "sha256": [f"{i:064x}" for i in mine],
            "original_caption": [captions[i] for i in mine], "status": ["ok"] * n,
            "error": pa.nulls(n, pa.string()), "url": pa.nulls(n, pa.string()),
            "unit": [f"img/{i}.jpg" for i in mine], "unit_signature": ["generated"] * n,
            "unit_items": np.ones(n, np.int64)},
        ).cast(RAW_IMAGES_SCHEMA))
        versions = []
        for version, text in (("v2", [captions[i] for i in mine]), ("v1", ["an old caption"] * n)):
            versions.append(pa.table({
                "id": my_ids, "caption_version": [version] * n, "caption": text,
                "n_words": np.full(n, 40, np.int32), "model": ["bench"] * n,
                "backend": ["original"] * n, "status": ["ok"] * n,
                "error": pa.nulls(n, pa.string()), "created_at": [now] * n}
            ).cast(CAPTIONS_SCHEMA))
        _write(table_ref(root, "captions", name), pa.concat_tables(versions))
        scores = np.full(n, 0.9, np.float32)
        _write(table_ref(root, "caption_labels", name), pa.table({
            "id": my_ids, "caption_version": ["v2"] * n, "classifier_version": ["c1"] * n,
            "label": labels[mine], "score_visual": scores, "score_text": 1 - scores,
            "score_nsfw": np.zeros(n, np.float32),
            "embedding": pa.FixedSizeListArray.from_arrays(pa.array(vectors[mine].ravel()),
                                                           EMBEDDING_DIM),
            "created_at": [now] * n}).cast(LABELS_SCHEMA))
        leaf = "512/512x512"
        tree = root / "mds" / name
        (tree / leaf).mkdir(parents=True, exist_ok=True)
        shard_of = np.arange(n) // SAMPLES_PER_SHARD
        _write(table_ref(root, "mds_samples", name), pa.table({
            "id": my_ids, "source": [name] * n, "tier": np.full(n, 512, np.int32),
            "width": widths[mine], "height": heights[mine], "leaf": [leaf] * n,
            "shard": [f"shard.{s:05d}.mds" for s in shard_of],
            "sample_index": (np.arange(n) % SAMPLES_PER_SHARD).astype(np.int64),
            "tree_version": ["t1"] * n, "fingerprint": np.zeros(n, np.int64)}
            ).cast(MDS_SAMPLES_SCHEMA))
        skipped = copies[mine]
        for s in range(int(shard_of.max()) + 1):
            (tree / leaf / f"shard.{s:05d}.mds").write_bytes(b"")
            local = np.flatnonzero(skipped[shard_of == s])
            (tree / leaf / f"shard.{s:05d}.skip.json").write_text(json.dumps(
                {"version": 1, "lists": {"dedup": local.tolist()}}))
    kept_of = np.arange(rows)
    kept_of[copies] -= 1
    members = np.flatnonzero(copies | np.roll(copies, -1))
    _write(table_ref(root, "duplicates"), pa.table({
        "id": [ids[i] for i in members], "kept_id": [ids[kept_of[i]] for i in members],
        "phash": phash[members], "group_size": np.full(len(members), 2, np.int32)}
    ).cast(DUPLICATES_SCHEMA))
    _write(table_ref(root, "opt_outs"), AUDIT_SCHEMA.empty_table())
    return {"ids": ids, "copies": np.flatnonzero(copies)}


# ------------------------------------------------------------------------------- baselines

def bare_grid(catalog: Catalog) -> None:
    table = catalog.corpus()
    table.count_rows()
    table.to_table(columns=queries.GRID_COLUMNS, limit=queries.PAGE_SIZE)
    table.to_table(columns=FACET_COLUMNS, limit=queries.MAX_FACET_ROWS,
                   with_row_address=True)


def bare_search(catalog: Catalog, text: str) -> None:
    catalog.corpus().to_table(columns=[*FACET_COLUMNS, "id", "caption", "_score"],
                              full_text_query=text, limit=queries.MAX_SEARCH_HITS,
                              with_row_address=True)


def bare_sample(catalog: Catalog, sample_id: str) -> None:
    where = f"id = '{sample_id}'"
    source = sample_id.split(":")[0]
    catalog.corpus().to_table(columns=["id", "source", "tier", "width", "height", "caption",
                                       "label", "phash"], filter=where, limit=1)
    catalog.dataset("bucketed_images", source).to_table(
        columns=["status", "tier", "width", "height", "original_width", "original_height",
                 "error", "pixels", "flat"], filter=where, limit=1)
    catalog.dataset("raw_images", source).to_table(
        columns=["source_key", "sha256", "format", "n_bytes", "width", "height", "url",
                 "status"], filter=where, limit=1)
    catalog.dataset("captions", source).to_table(
        columns=["caption_version", "caption", "n_words", "model", "backend", "status",
                 "error", "created_at"], filter=where, limit=100)
    catalog.dataset("caption_labels", source).to_table(
        columns=["caption_version", "classifier_version", "label", "score_visual",
                 "score_text", "score_nsfw", "created_at"], filter=where, limit=100)
    dup = catalog.dataset("duplicates").to_table(columns=["kept_id", "phash", "group_size"],
                                               filter=where, limit=1)
    if dup.num_rows:
        catalog.dataset("duplicates").to_table(
            columns=["id", "kept_id", "phash", "group_size"],
            filter=f"kept_id = '{dup.column('kept_id')[0].as_py()}'", limit=2)
    catalog.dataset("mds_samples", source).to_table(
        columns=["leaf", "shard", "sample_index", "tree_version"], filter=where, limit=16)
    catalog.dataset("opt_outs").to_table(
        columns=["request_id", "key_type", "value", "reference", "requested_at", "via"],
        filter=where, limit=100)


# ---------------------------------------------------------------------------------- timing

def median_s(fn, repeats: int = REPEATS) -> float:
    fn()  # warm: opened datasets, page cache, the browser's per-version caches
    return statistics.median(timed(fn)[0] for _ in range(repeats))


def get(port: int, path: str) -> bytes:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        body = response.read()
        if response.status != 200:
            raise RuntimeError(f"GET {path}: {response.status} {body[:200]!r}")
        return body
    finally:
        connection.close()


def first_thumbnail_ms(url: str, loads: int = 5) -> float:
    """Median over fresh browser contexts (empty cache) of navigation start to the first
    thumbnail's response end."""
    from playwright.sync_api import sync_playwright

    from prx_assets.testing.chromium import CHROMIUM_ARGS, chromium_path

    times = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path(), headless=True,
                                             args=CHROMIUM_ARGS)
        for _ in range(loads + 1):
            context = browser.new_context(viewport={"width": 1400, "height": 1000})
            page = context.new_page()
            page.goto(url + "/")
            page.wait_for_function("() => { const i = document.querySelector('#grid img');"
                                   " return i && i.complete && i.naturalWidth > 0; }")
            times.append(page.evaluate("""() => Math.min(...performance
                .getEntriesByType('resource').filter(e => e.name.includes('/thumb/'))
                .map(e => e.responseEnd))"""))
            context.close()
        browser.close()
    return statistics.median(times[1:])


def main() -> list[Figure]:
    import threading

    import uvicorn

    from prx_assets.browser.app import create_app
    from prx_assets.testing.chromium import free_port

    work = Path(tempfile.mkdtemp(prefix="bench_browser_"))
    try:
        seconds, generated = timed(lambda: generate(work / "data"))
        print(f"browser: generated {ROWS:,} corpus rows and their tables in {seconds:.0f} s")
        ids = generated["ids"]
        sample_id = ids[generated["copies"][len(generated["copies"]) // 2]]
        text = "bicycle lamp"
        catalog = Catalog(work / "data")
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(create_app(work / "data"), host="127.0.0.1",
                                               port=port, log_level="warning", lifespan="off"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("the browser app did not start")
            thread.join(0.05)
        try:
            views = {"grid": ("/", lambda: bare_grid(catalog)),
                     "search": (f"/?q={text.replace(' ', '+')}",
                                lambda: bare_search(catalog, text)),
                     "sample page": (f"/sample/{sample_id}",
                                     lambda: bare_sample(catalog, sample_id))}
            figures = []
            for name, (path, bare) in views.items():
                # Interleaved, best of medians: the machine is shared with other jobs.
                served_s = bare_s = float("inf")
                for _ in range(2):
                    served_s = min(served_s, median_s(lambda path=path: get(port, path)))
                    bare_s = min(bare_s, median_s(bare))
                figures.append(Figure("browser", f"{name} server ms", served_s * 1e3,
                                      "bare Lance queries", bare_s * 1e3, "ms"))
            ttft = first_thumbnail_ms(f"http://127.0.0.1:{port}")
            grid_ms = figures[0].value
            figures.append(Figure("browser", "first thumbnail ms", ttft, "grid server ms",
                                  grid_ms, "ms"))
        finally:
            server.should_exit = True
            thread.join(30)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(figures, "browser")
    return figures


if __name__ == "__main__":
    main()
