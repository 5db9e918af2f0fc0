"""The grid's layout holds at common window widths: no facet runs over the thumbnails.

The corpus is written straight into a corpus table (no pipeline run): what matters is a
shape facet as wide as a real corpus makes it (three tiers, eight aspect ratios, as the demo
has) beside the grid, in a real Chromium.
"""

from __future__ import annotations

import io

import pyarrow as pa
import pytest
from PIL import Image

from prx_assets.stages.corpus.corpus import CORPUS_SCHEMA
from prx_assets.storage.lance_tables import overwrite_rows
from prx_assets.storage.layout import Storage
from prx_assets.storage.tables import CORPUS
from prx_assets.testing.chromium import screenshot
from prx_assets_tests.browser.conftest import ServedApp

pytestmark = pytest.mark.browser

WIDTHS = (1280, 1500, 1920)
TIERS = {512: 512, 1024: 1024, 2048: 2048}
ASPECTS = (0.5, 0.56, 0.63, 0.71, 0.79, 1.0, 1.41, 2.0)


def _thumbnail(n: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (64, 48), (n * 37 % 255, n * 91 % 255, 120)).save(buffer, "JPEG")
    return buffer.getvalue()


def _rows() -> list[dict]:
    rows = []
    for tier in TIERS:
        for aspect in ASPECTS:
            width = round(tier * aspect ** 0.5 / 16) * 16
            height = round(tier / aspect ** 0.5 / 16) * 16
            for copy in range(2):
                n = len(rows)
                rows.append({"id": f"wide:{n:04x}", "source": "a_source_with_a_long_name",
                             "tier": tier, "width": width, "height": height,
                             "caption": f"picture {n} of a wide corpus", "label": "visual",
                             "phash": n, "thumbnail": _thumbnail(n), "made_from": str(copy)})
    return rows


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    root = tmp_path_factory.mktemp("wide_corpus")
    overwrite_rows(Storage(str(root)).table(CORPUS),
                   pa.Table.from_pylist(_rows(), schema=CORPUS_SCHEMA), CORPUS_SCHEMA)
    with ServedApp(root) as app:
        yield app


def _overlaps(a: dict, b: dict) -> bool:
    return (a["x"] < b["x"] + b["width"] and b["x"] < a["x"] + a["width"]
            and a["y"] < b["y"] + b["height"] and b["y"] < a["y"] + a["height"])


BOXES = """sel => [...document.querySelectorAll(sel)].map(e => {
    const r = e.getBoundingClientRect();
    return {x: r.x, y: r.y, width: r.width, height: r.height,
            what: e.tagName + (e.dataset.value ? ':' + e.dataset.value : '')};
}).filter(r => r.width > 0 && r.height > 0)"""


@pytest.mark.parametrize("width", WIDTHS)
def test_no_facet_overlaps_the_grid(wide, page, width):
    page.set_viewport_size({"width": width, "height": 1000})
    page.goto(wide.url + "/")
    shape = page.locator('[data-facet="shape"] table')
    shape.wait_for()
    assert shape.locator("a[data-value]").count() == len(TIERS) * len(ASPECTS)
    facets = page.evaluate(BOXES, ".facets, .facets *")
    tiles = page.evaluate(BOXES, "#grid .tile")
    assert len(tiles) == len(TIERS) * len(ASPECTS) * 2
    over = [(f["what"], t["what"]) for f in facets for t in tiles if _overlaps(f, t)]
    assert not over, f"at {width} px facets run over thumbnails: {over[:5]}"
    sidebar = page.locator(".facets").bounding_box()
    first = min(t["x"] for t in tiles)
    assert sidebar["x"] + sidebar["width"] <= first
    screenshot(page, f"grid-{width}px")
