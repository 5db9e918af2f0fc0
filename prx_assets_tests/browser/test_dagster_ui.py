"""The first thing a user does, in a real browser: open the Dagster UI (`dagster dev` on a
temporary instance with the repo's dagster.yaml), launch one source partition of
`raw_images` from the asset page, watch the run succeed through the queued run coordinator
and the daemon, and read the asset's metadata tables and check results.

Every wait is on something the UI shows (the dialog, the toast, the run's status tag, the
metadata rows); the long timeouts only stop a broken run from hanging the suite: on this
machine a run spends most of its time starting step processes.
"""

from __future__ import annotations

import json
import re
import urllib.request

import pytest

from prx_assets.testing import tiny_corpus
from prx_assets.testing.chromium import free_port, screenshot
from prx_assets.testing.dagster_ui import DagsterDev
from prx_assets.testing.sources import folder_source, write_sources

pytestmark = pytest.mark.browser

RUN_SAFETY_NET_MS = 900_000
SOURCE = "ui_src"


@pytest.fixture(scope="module")
def dagster_dev(tmp_path_factory):
    root = tmp_path_factory.mktemp("dagster_ui")
    folder = root / SOURCE
    folder.mkdir()
    for key, photo in (("astronaut.jpg", "astronaut.png"), ("coins.jpg", "coins.png")):
        (folder / key).write_bytes(tiny_corpus._image(photo, key))
        (folder / key).with_suffix(".txt").write_text(f"a photo: {photo}")
    (folder / "broken.jpg").write_bytes(b"not an image at all")
    sources = write_sources(root / "sources.yaml", [folder_source(SOURCE, folder)])
    env = {"PRX_SOURCES": str(sources), "PRX_DATA_ROOT": str(root / "data"),
           "HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}
    env.pop("RAY_ADDRESS", None)
    with DagsterDev(root / "dagster_home", free_port(), env, root / "dagster.log") as dev:
        # The first-visit community dialog covers the page; mark it seen, as a user would.
        request = urllib.request.Request(
            dev.url + "/graphql", data=json.dumps({"query": "mutation { setNuxSeen }"}).encode(),
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            assert json.loads(response.read())["data"]["setNuxSeen"] is True
        yield dev


@pytest.mark.timeout(1500)  # dagster dev's start and a run's step processes, on 2 busy cores
def test_launch_a_partition_from_the_asset_page(dagster_dev, page):
    page.goto(dagster_dev.url + "/assets/raw_images")
    page.get_by_role("button", name="Materialize…").click()
    dialog = page.get_by_role("dialog")
    dialog.get_by_text("Launch runs to materialize raw_images").wait_for()
    # The partition picker: open it, tick the source, close it.
    dialog.get_by_text("Select a partition or create one").click()
    page.get_by_text(SOURCE, exact=True).filter(visible=True).click()
    dialog.get_by_text("Launch runs to materialize raw_images").click()
    launch = dialog.get_by_role("button", name="Launch 1 run")
    launch.wait_for()
    screenshot(page, "dagster_launch")
    launch.click()

    toast = page.get_by_text(re.compile(r"^Launched run [0-9a-f]{8}$"))
    toast.wait_for()
    run_id = toast.inner_text().split()[-1]
    page.get_by_role("button", name="View").or_(page.get_by_role("link", name="View")) \
        .first.click()
    page.wait_for_url(f"**/runs/{run_id}*")
    # The queued run coordinator hands the run to the daemon, which launches it; its status
    # tag in the run header ends on one of these.
    header = page.locator("text=/^(Success|Failure|Canceled)$/").first
    header.wait_for(timeout=RUN_SAFETY_NET_MS)
    assert header.inner_text() == "Success"
    screenshot(page, "dagster_run")

    # The partition's latest materialisation: its metadata, tables rendered inline.
    page.goto(dagster_dev.url + f"/assets/raw_images?partition={SOURCE}")
    for key in ("rejects_by_reason", "formats", "lance_version", "ok_rows", "rejected_rows"):
        page.get_by_text(key, exact=True).first.wait_for()
    row = page.locator("tr", has=page.get_by_text("rejects_by_reason", exact=True)).first
    row.get_by_text("not_an_image", exact=True).wait_for()  # the broken file's reason
    assert row.locator("td", has_text=re.compile(r"^1$")).count() >= 1
    screenshot(page, "dagster_metadata", full_page=True)

    # Check results of that run: two pass, the reject share (1 of 3 files) warns.
    page.goto(dagster_dev.url + "/assets/raw_images?view=checks")
    expected = {"fragments_healthy": "Succeeded", "ids_unique": "Succeeded",
                "reject_share": "Failed"}
    for check, status in expected.items():
        item = page.locator("a, button, div", has=page.get_by_text(check, exact=True)) \
            .filter(has=page.get_by_text(status, exact=True)).last
        item.wait_for()
    assert page.get_by_text("In Progress", exact=True).count() == 0
    screenshot(page, "dagster_checks")


@pytest.mark.timeout(600)
def test_the_funnel_and_histograms_draw_on_the_asset_page(dagster_dev, page):
    """skip_lists (the last per-source asset) carries the source's funnel as a table and a
    bar chart; raw_images its megapixel and aspect-ratio histograms. Dagster draws Markdown
    inline only under 1,000 characters (else it hides it behind [Show Markdown]): the charts
    are bars of block characters in Markdown tables under that, drawn on the page at once.
    The materialisations are reported directly: what is tested is what the UI renders of
    the metadata the assets record (test_dedup_skip_lists and test_images run them)."""
    import dagster as dg

    from prx_assets.defs.report import bands_chart, funnel_metadata, tier_shape_matrix
    from prx_assets.stages.report.funnel import Funnel

    funnel = Funnel(SOURCE, raw=124, decodable=120, kept=107, captioned=107, labelled=107,
                    duplicates=6, skipped=8, in_shards=107, opt_in={"balance": 45})
    instance = dg.DagsterInstance.from_config(str(dagster_dev.home))
    instance.report_runless_asset_event(dg.AssetMaterialization(
        "skip_lists", partition=SOURCE, metadata={
            **funnel_metadata(funnel),
            "tier_by_shape": tier_shape_matrix({(512, "512x512"): 60, (512, "608x432"): 47})}))
    bands = {"< 0.25 MP": 3, "0.25-0.5 MP": 40, "0.5-1 MP": 51, "1-2 MP": 26, "2-4 MP": 4}
    instance.report_runless_asset_event(dg.AssetMaterialization(
        "raw_images", partition=SOURCE, metadata={
            "megapixels_chart": bands_chart(bands, "decodable images by megapixels"),
            "aspect_ratios_chart": bands_chart({"0.75": 30, "1": 70, "1.33": 24},
                                               "decodable images by width / height")}))
    page.set_viewport_size({"width": 1500, "height": 1000})
    page.goto(dagster_dev.url + f"/assets/skip_lists?partition={SOURCE}")
    row = page.locator("tr", has=page.get_by_text("funnel", exact=True)).first
    row.get_by_text("streamed by loader", exact=True).wait_for()
    assert row.get_by_text("79.8 %", exact=True).count() == 1
    matrix = page.locator("tr", has=page.get_by_text("tier_by_shape", exact=True)).first
    matrix.get_by_text("47 · 608x432").wait_for()  # a Markdown table, rendered inline
    chart = page.locator("tr", has=page.get_by_text("funnel_chart", exact=True)).first
    chart.get_by_text(f"{SOURCE}: where the images go").wait_for()  # drawn, not behind a link
    assert chart.get_by_text("[Show Markdown]").count() == 0
    bars = chart.locator("td", has_text=re.compile("^[█▏▎▍▌▋▊▉]+$"))
    assert bars.count() == len(funnel.rows())  # a bar per stage
    text_width = ("e => { const r = document.createRange(); r.selectNodeContents(e); "
                  "return r.getBoundingClientRect().width; }")
    widths = bars.evaluate_all(f"els => els.map({text_width})")
    assert max(widths) > 3 * min(widths)  # bars drawn to scale: raw against skipped
    # Drawn whole: the chart ends inside its cell (the UI clips what runs over).
    cell = chart.locator(":scope > td").last.bounding_box()
    drawn = chart.locator("table").first.bounding_box()
    assert drawn["x"] + drawn["width"] <= cell["x"] + cell["width"], (drawn, cell)
    page.get_by_text("balance 45 (skipped only when named)").wait_for()
    chart.scroll_into_view_if_needed()
    screenshot(page, "dagster_funnel")

    page.goto(dagster_dev.url + f"/assets/raw_images?partition={SOURCE}")
    for key, title in (("megapixels_chart", "decodable images by megapixels"),
                       ("aspect_ratios_chart", "decodable images by width / height")):
        histogram = page.locator("tr", has=page.get_by_text(key, exact=True)).first
        histogram.get_by_text(title).wait_for()
        assert histogram.get_by_text("[Show Markdown]").count() == 0
        assert histogram.locator("td", has_text=re.compile("^█")).count() >= 3
    screenshot(page, "dagster_histograms")
