"""The corpus browser in a real headless Chromium, over a tiny corpus the whole graph made.

Every wait is on evidence in the page (an element, a URL, a loaded image); the context's
default timeout is only a safety net. The opt-out test changes the corpus' skip lists, so it
runs last.
"""

from __future__ import annotations

import http.client
import io
import re
from urllib.parse import quote

import pytest
from PIL import Image

from prx_assets.storage.sidecars import read_sidecar
from prx_assets.storage.trees import current_tree
from prx_assets.testing import tiny_corpus
from prx_assets.testing.chromium import screenshot
from prx_assets.testing.served_app import CURATOR_TOKEN
from prx_assets.testing.tiny_corpus import table_ref

pytestmark = pytest.mark.browser

ALL_THUMBS_LOADED = """() => {
  const imgs = [...document.querySelectorAll('#grid .tile img')];
  return imgs.length > 0 && imgs.every(i => i.complete && i.naturalWidth > 0);
}"""


def corpus_ids(tiny) -> list[str]:
    table = table_ref(tiny.data_root, "corpus")
    return table.to_table(columns=["id"]).column("id").to_pylist()


def tile_ids(page) -> list[str]:
    return page.locator("#grid .tile").evaluate_all("els => els.map(e => e.dataset.id)")


def facet(page, name: str) -> dict[str, int]:
    items = page.locator(f'[data-facet="{name}"] li')
    return {items.nth(i).locator("a").inner_text(): int(items.nth(i).locator(".count")
                                                         .inner_text())
            for i in range(items.count())}


def shape_cells(page) -> dict[str, int]:
    """The shape facet's grid: shape -> count, from its cells (tier rows, aspect columns)."""
    links = page.locator('[data-facet="shape"] td a')
    return {links.nth(i).get_attribute("data-value"): int(links.nth(i).inner_text())
            for i in range(links.count())}


def test_grid_loads_real_thumbnails(served, tiny, page):
    page.goto(served.url + "/")
    page.wait_for_function(ALL_THUMBS_LOADED)
    screenshot(page, "grid")
    ids = corpus_ids(tiny)
    assert sorted(tile_ids(page)) == sorted(ids)
    assert page.locator("#total").inner_text() == str(len(ids))
    # Each thumbnail is the corpus table's JPEG (longest side 256), decoded by the browser.
    sizes = page.locator("#grid .tile img").evaluate_all(
        "els => els.map(e => [e.naturalWidth, e.naturalHeight])")
    assert all(max(w, h) == 256 for w, h in sizes), sizes
    response = page.request.get(served.url + f"/thumb/{ids[0]}")
    assert response.status == 200 and response.headers["content-type"] == "image/jpeg"
    assert "max-age" in response.headers["cache-control"]
    stored = table_ref(tiny.data_root, "corpus").to_table(
        columns=["thumbnail"], filter=f"id = '{ids[0]}'").column("thumbnail")[0].as_py()
    assert response.body() == stored
    assert Image.open(io.BytesIO(response.body())).format == "JPEG"
    again = page.request.get(served.url + f"/thumb/{ids[0]}",
                             headers={"If-None-Match": response.headers["etag"]})
    assert again.status == 304


def test_caption_search_finds_the_right_sample(served, tiny, page):
    page.goto(served.url + "/")
    page.fill('input[type="search"]', "tabby cat")
    page.press('input[type="search"]', "Enter")
    page.wait_for_url(re.compile(r"q=tabby"))
    page.wait_for_function(ALL_THUMBS_LOADED)
    screenshot(page, "search")
    assert tile_ids(page) == [tiny.id("web", "cat.jpg")]
    assert page.locator('input[type="search"]').input_value() == "tabby cat"


def test_a_facet_narrows_the_counts(served, tiny, page):
    page.goto(served.url + "/")
    before = facet(page, "source")
    assert before == {"web": 5, "stock": 4}
    assert sum(shape_cells(page).values()) == 9
    # A row per aspect ratio, a column per tier: here four shapes of one tier (512).
    assert page.locator('[data-facet="shape"] tr').count() == 5
    assert page.locator('[data-facet="shape"] tr').first.locator("th").count() == 2
    assert shape_cells(page) == {"608x432": 5, "512x512": 2, "576x464": 1, "640x400": 1}
    page.locator('[data-facet="source"] a[data-value="stock"]').click()
    page.wait_for_url(re.compile(r"source=stock"))
    assert page.locator("#total").inner_text() == "4"
    assert facet(page, "source") == {"stock": 4}
    assert sum(shape_cells(page).values()) == 4
    assert all(i.startswith("stock:") for i in tile_ids(page)) and len(tile_ids(page)) == 4
    assert facet(page, "dup") == {"duplicate": 2, "unique": 2}
    page.wait_for_function(ALL_THUMBS_LOADED)
    screenshot(page, "facet")
    # Combined with a search: the facet keeps narrowing the matches of the query.
    page.fill('input[type="search"]', "latte")
    page.press('input[type="search"]', "Enter")
    page.wait_for_url(re.compile(r"q=latte"))
    assert set(facet(page, "source")) == {"web", "stock"}
    page.locator('[data-facet="source"] a[data-value="stock"]').click()
    page.wait_for_url(re.compile(r"q=latte.*source=stock|source=stock.*q=latte"))
    assert tile_ids(page) == [tiny.id("stock", "coffee-bright.jpg")]
    page.locator('[data-facet="dup"] a[data-value="duplicate"]').click()
    page.wait_for_url(re.compile(r"dup=duplicate"))
    assert tile_ids(page) == [tiny.id("stock", "coffee-bright.jpg")]


def test_facet_counts_say_when_they_cover_part_of_the_matches(served, page, monkeypatch):
    from prx_assets.browser import queries

    page.goto(served.url + "/")
    assert page.locator("#facets-partial").count() == 0
    monkeypatch.setattr(queries, "MAX_FACET_ROWS", 3)
    page.goto(served.url + "/")
    assert "first 3 matches" in page.locator("#facets-partial").inner_text()
    assert sum(facet(page, "source").values()) == 3
    assert page.locator("#total").inner_text() == "9"


def test_sample_page_shows_every_caption_version(served, tiny, page):
    sample = tiny.id("web", "astronaut.jpg")
    page.goto(served.url + "/")
    page.locator(f'#grid .tile[data-id="{sample}"] a').click()
    page.wait_for_url(f"**/sample/{sample}")
    versions = page.locator(".caption-version").evaluate_all(
        "els => els.map(e => e.dataset.version)")
    captions = table_ref(tiny.data_root, "captions", "web").to_table(
        columns=["caption_version"], filter=f"id = '{sample}'")
    assert sorted(versions) == sorted(captions.column("caption_version").to_pylist())
    assert tiny_corpus.OLD_VERSION in versions and len(versions) == 2
    assert "old caption: astronaut" in page.locator("#captions").inner_text()
    page.wait_for_function("() => { const i = document.querySelector('#full-image');"
                           " return i.complete && i.naturalWidth > 0; }")
    assert page.locator("#full-image").evaluate("i => i.naturalWidth") == 512
    # The original (640x640 on disk) beside its bucketed crop, and where it was made.
    page.wait_for_function("() => { const i = document.querySelector('#original-image');"
                           " return i.complete && i.naturalWidth > 0; }")
    assert page.locator("#original-image").evaluate(
        "i => [i.naturalWidth, i.naturalHeight]") == [640, 640]
    assert page.locator("#dagster-run").get_attribute("href") == (
        "http://127.0.0.1:3000/assets/captions?partition=web")  # served without an instance
    screenshot(page, "sample", full_page=True)
    # The exact copy in the other source, with the kept one marked; lineage and labels.
    group = page.locator("#group").inner_text()
    assert tiny.id("stock", "spaceman.jpg") in group and "kept" in group
    raw = table_ref(tiny.data_root, "raw_images", "web").to_table(
        columns=["sha256"], filter=f"id = '{sample}'").column("sha256")[0].as_py()
    assert raw in page.locator("#lineage").inner_text()
    assert "astronaut.jpg" in page.locator("#lineage").inner_text()
    assert page.locator("#labels tr").count() == 2  # header + the active label row
    assert "512x512" in page.locator("#skips").inner_text()


def test_removed_copy_shows_its_skip_reason(served, tiny, page):
    page.goto(served.url + f"/sample/{tiny.id('stock', 'spaceman.jpg')}")
    assert page.locator("#skips .reasons").inner_text() == "dedup"
    assert "removed copy" in page.locator("#group").inner_text()


def test_more_like_this(served, tiny, page):
    sample = tiny.id("web", "astronaut.jpg")
    page.goto(served.url + f"/sample/{sample}")
    page.click("#more-like-this")
    page.wait_for_url(re.compile(r"similar="))
    ids = tile_ids(page)
    assert sample not in ids and len(ids) == 8
    assert ids[0] == tiny.id("stock", "spaceman.jpg")  # its copy's caption is nearest


def test_duplicates_page_has_near_and_exact_clusters(served, tiny, page):
    page.goto(served.url + "/")
    page.click("text=Duplicates")
    page.wait_for_url("**/duplicates")
    near = page.locator("#near-clusters .cluster")
    assert near.count() == 1
    titles = near.locator("a").evaluate_all("els => els.map(e => e.title)")
    assert sorted(titles) == sorted([tiny.id("web", "motorbike.jpg"),
                                     tiny.id("stock", "motorbike-crop.jpg")])
    exact = page.locator("#exact-groups .cluster")
    assert exact.count() == 2
    kept = page.locator("#exact-groups a.kept").evaluate_all("els => els.map(e => e.title)")
    assert sorted(kept) == sorted([tiny.id("web", "astronaut.jpg"),
                                   tiny.id("web", "coffee.jpg")])
    # Readable groups: titled by the kept copy's key and source, byte-identical files told
    # from re-encoded copies of the same phash, why this copy was kept, and a legend.
    kinds = {exact.nth(i).locator(".group-title").inner_text().split(" (")[0]:
             exact.nth(i).get_attribute("data-kind") for i in range(2)}
    assert kinds == {"astronaut.jpg": "bytes", "coffee.jpg": "phash"}
    astronaut = exact.filter(has_text="astronaut.jpg")
    assert "(web)" in astronaut.locator(".group-title").inner_text()
    assert "identical bytes" in astronaut.inner_text() and "spaceman.jpg" in astronaut.inner_text()
    assert "tie goes to the first source" in astronaut.locator(".why-kept").inner_text()
    assert "640x640" in astronaut.inner_text()
    assert "byte-identical" in page.locator("#legend").inner_text()
    page.goto(served.url + f"/sample/{tiny.id('web', 'motorbike.jpg')}")
    assert "distance 2" in page.locator("#near").inner_text()
    page.goto(served.url + "/duplicates")
    page.wait_for_function("() => [...document.querySelectorAll('.cluster img')]"
                           ".every(i => i.complete && i.naturalWidth > 0)")
    screenshot(page, "duplicates")


def test_random_sample(served, tiny, page):
    page.goto(served.url + "/")
    page.click("#random")
    page.wait_for_url(re.compile(r"/sample/"))
    assert page.locator("h1.sample-id").inner_text() in corpus_ids(tiny)


def test_grid_cards_say_which_samples_train(served, tiny, page):
    page.goto(served.url + "/")
    page.wait_for_function(ALL_THUMBS_LOADED)
    fates = dict(zip(tile_ids(page), page.locator("#grid .tile .badge").all_inner_texts(),
                     strict=True))
    removed = {i for i, words in fates.items() if words == "removed: duplicate"}
    # The two copies dedup removed (the facet counts the same ones), every other card trains.
    assert removed == {tiny.id("stock", "spaceman.jpg"), tiny.id("stock", "coffee-bright.jpg")}
    assert facet(page, "dup")["duplicate"] == len(removed)
    assert {words for i, words in fates.items() if i not in removed} == {"trains"}
    header = {page.locator("#fates [data-fate]").nth(i).get_attribute("data-fate"):
              int(page.locator("#fates [data-fate]").nth(i).inner_text().split()[0])
              for i in range(3)}
    assert header == {"trains": 7, "skipped": 0, "removed": 2}
    assert sum(header.values()) == int(page.locator("#total").inner_text())


def test_search_cards_name_their_score(served, page):
    page.goto(served.url + "/?q=tabby+cat")
    score = page.locator("#grid .tile .score").first.inner_text()
    assert re.fullmatch(r"relevance \(BM25\) [0-9]+\.[0-9]{2}", score), score
    page.goto(served.url + "/")
    assert page.locator("#grid .tile .score").count() == 0


def test_rejected_view_shows_what_was_thrown_away(served, tiny, page):
    page.goto(served.url + "/")
    page.click("#rejected-link")
    page.wait_for_url("**/rejected")
    reasons = page.locator('[data-facet="reject"] a').evaluate_all(
        "els => els.map(e => [e.dataset.reason, e.dataset.source])")
    assert reasons == [["too_small", "stock"]]  # the 200x200 photo, below the 384 floor
    # It opens on the largest reason (across sources), in the grid's multi-column layout.
    assert page.locator("#reject-title").inner_text().startswith("too_small")
    tracks = page.locator("#rejects").evaluate(
        "g => getComputedStyle(g).gridTemplateColumns.split(' ').length")
    assert tracks >= 4, tracks  # 1,400 px wide: as many columns as the grid's
    tile_width = page.locator("#rejects .tile").first.bounding_box()["width"]
    assert tile_width < 400, tile_width
    page.locator('[data-facet="reject"] a').first.click()
    page.wait_for_url(re.compile(r"reason=too_small"))
    tiny_id = tiny.id("stock", "tiny.jpg")
    assert tile_ids_of(page, "#rejects") == [tiny_id]
    assert page.locator("#reject-total").inner_text() == "1"
    tile = page.locator(f'#rejects .tile[data-id="{tiny_id}"]')
    assert tile.locator(".badge").inner_text() == "rejected: too_small"
    assert "200x200" in tile.inner_text()
    image = tile.locator("img")
    page.wait_for_function("i => i.complete && i.naturalWidth > 0", arg=image.element_handle())
    assert image.evaluate("i => [i.naturalWidth, i.naturalHeight]") == [200, 200]
    screenshot(page, "rejected")
    assert page.request.get(served.url + "/rejected?reason=..%2F").status == 400
    assert page.request.get(served.url + "/rejected?reason=too_small&source=nope").status == 404
    assert page.request.get(served.url + f"/reject-thumb/{tiny.id('stock', 'nope.jpg')}"
                            ).status == 404


def tile_ids_of(page, grid: str) -> list[str]:
    return page.locator(f"{grid} .tile").evaluate_all("els => els.map(e => e.dataset.id)")


def test_no_page_logs_a_console_error_or_a_failed_request(served, tiny, page):
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("response", lambda r: errors.append(f"{r.status} {r.url}")
            if r.status >= 400 else None)
    sample = tiny.id("web", "astronaut.jpg")
    for path in ("/", "/?q=cat", f"/?similar={sample}", f"/sample/{sample}",
                 f"/sample/{sample}/opt-out", "/duplicates", "/?source=stock&dup=duplicate",
                 "/rejected", "/rejected?reason=too_small&source=stock"):
        page.goto(served.url + path)
        page.wait_for_load_state("load")
    assert errors == []
    icon = page.request.get(served.url + "/favicon.ico")
    assert icon.status == 200 and icon.headers["content-type"].startswith("image/svg+xml")


def _raw_get(served, path: str) -> tuple[int, bytes]:
    """A request with the path exactly as written (a browser would normalise `..`)."""
    connection = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


@pytest.mark.parametrize("path", [
    "/thumb/..%2F..%2F..%2Fetc%2Fpasswd",
    "/image/../../pyproject.toml",
    "/image/web:..%2F..%2Flance%2Fcorpus.lance",
    "/sample/..%2F..%2Fetc%2Fpasswd",
    "/sample/%2e%2e%2f%2e%2e%2fetc%2fpasswd",
    "/sample/web:x'%20OR%20'1'='1",
    "/static/../app.py",
    "/static/..%2Fapp.py",
    "/static/%2e%2e/queries.py",
    "/thumb/%00",
    "/etc/passwd",
])
def test_traversal_style_urls_get_404(served, path):
    status, body = _raw_get(served, path)
    assert status == 404, (path, status)
    assert b"root:" not in body and b"import" not in body and b"[project]" not in body


def test_inputs_are_escaped_and_bad_ones_rejected(served, page):
    dialogs = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    script = "<script>alert(1)</script>"
    page.goto(served.url + "/?q=" + quote(script))
    assert page.locator('input[type="search"]').input_value() == script
    assert "<script>alert" not in page.content().split("</header>", 1)[1]
    assert not dialogs
    for bad in ("/?label=cat", "/?tier=abc", "/?shape=1x1%27", "/?page=-1", "/?source=..%2F"):
        response = page.request.get(served.url + bad)
        assert response.status == 400, bad
    assert page.request.get(served.url + "/?similar=nope").status == 404


def test_opt_out_post_needs_a_curator(served, tiny, page):
    sample = tiny.id("web", "coffee.jpg")
    response = page.request.post(served.url + f"/sample/{sample}/opt-out",
                                 form={"token": "forged", "confirm": "yes"})
    assert response.status == 401
    assert not list((tiny.data_root / "opt_outs").glob("browser-*.jsonl"))


def test_links_to_the_browser_in_asset_metadata(tiny):
    import dagster as dg

    from prx_assets.testing.fault_runs import open_instance

    instance = open_instance(tiny.home)

    def latest(asset: str, partition: str | None = None) -> dict:
        records = instance.fetch_materializations(dg.AssetRecordsFilter(
            asset_key=dg.AssetKey(asset),
            asset_partitions=[partition] if partition else None), limit=1).records
        return records[0].asset_materialization.metadata

    base = tiny_corpus.BROWSER_URL
    assert latest("corpus")["browser"].value == base + "/"
    assert latest("raw_images", "web")["browser"].value == base + "/?source=web"
    assert latest("skip_lists", "stock")["browser"].value == base + "/?source=stock&skip=any"
    assert latest("duplicates")["browser"].value == base + "/duplicates"


def test_opt_out_from_the_page_reaches_audit_and_skip_lists(served, tiny, page):
    """Runs last: it opts a sample out for good."""
    sample = tiny.id("web", "rocket.jpg")
    page.goto(served.url + f"/sample/{sample}")
    page.click("#opt-out")
    page.wait_for_url(f"**/sample/{sample}/opt-out")
    page.click("#login-link")  # writing needs a curator: log in, and back to this form
    page.fill('input[name="token"]', CURATOR_TOKEN)
    page.click("#log-in")
    page.wait_for_selector("#curator")
    assert f"/sample/{sample}/opt-out" in page.url
    page.fill('input[name="reference"]', "ticket-42 <b>")
    # Not confirmed: the browser refuses to submit the form, and so does the server.
    assert page.locator('input[name="confirm"]').evaluate("e => e.validity.valueMissing")
    token = page.locator('input[name="token"]').input_value()
    unconfirmed = page.request.post(page.url, form={"token": token, "reference": "x"},
                                    headers={"Origin": served.url})
    assert unconfirmed.status == 400
    assert not list((tiny.data_root / "opt_outs").glob("browser-*.jsonl"))
    page.check('input[name="confirm"]')
    screenshot(page, "optout")
    page.click("#confirm-opt-out")
    page.wait_for_selector("#notice")
    assert f"/sample/{sample}" in page.url
    files = list((tiny.data_root / "opt_outs").glob("browser-*.jsonl"))
    assert len(files) == 1 and files[0].name in page.locator("#notice").inner_text()
    assert files[0].name in page.locator("#requested").inner_text()

    tiny_corpus.run_job(tiny, "dedup_job")  # the opt_outs audit
    tiny_corpus.run_job(tiny, "skip_lists_job", "web")
    audit = table_ref(tiny.data_root, "opt_outs").to_table(
        filter=f"id = '{sample}'").to_pylist()
    assert [(r["key_type"], r["value"], r["via"], r["reference"], r["requested_by"],
             r["door"]) for r in audit] == [
        ("id", sample, "direct", "ticket-42 <b>", "curator", "browser")]
    place = table_ref(tiny.data_root, "mds_samples", "web").to_table(
        filter=f"id = '{sample}'").to_pylist()[0]
    sidecar = (current_tree(tiny.data_root, "web") / place["leaf"] /
               place["shard"].replace(".mds", ".skip.json"))
    assert place["sample_index"] in read_sidecar(sidecar)["optout"]

    page.reload()
    assert "optout" in page.locator("#skips .reasons").inner_text()
    assert "direct" in page.locator("#opted-out").inner_text()
    page.goto(served.url + "/?skip=optout")
    assert tile_ids(page) == [sample]
    assert page.locator("#grid .tile .badge").inner_text() == "skipped: optout"
    assert page.locator('#fates [data-fate="skipped"]').inner_text() == "1 skipped"
