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
def test_the_funnel_picture_on_the_last_per_source_asset(dagster_dev, page):
    """skip_lists (the last per-source asset) carries the source's funnel as a table and a
    PNG in Markdown; the UI shows the table inline and the picture behind [Show Markdown]
    (Dagster inlines only Markdown under 1,000 characters), and the small tier × shape
    matrix inline. The materialisation is reported directly: what is tested is what the UI
    renders of the metadata skip_lists records (test_dedup_skip_lists runs the asset)."""
    import dagster as dg

    from prx_assets.defs.report import funnel_metadata, tier_shape_matrix
    from prx_assets.stages.report.funnel import Funnel

    funnel = Funnel(SOURCE, raw=124, decodable=120, kept=107, captioned=107, labelled=107,
                    duplicates=6, skipped=8, in_shards=107)
    instance = dg.DagsterInstance.from_config(str(dagster_dev.home))
    instance.report_runless_asset_event(dg.AssetMaterialization(
        "skip_lists", partition=SOURCE, metadata={
            **funnel_metadata(funnel),
            "tier_by_shape": tier_shape_matrix({(512, "512x512"): 60, (512, "608x432"): 47})}))
    page.goto(dagster_dev.url + f"/assets/skip_lists?partition={SOURCE}")
    row = page.locator("tr", has=page.get_by_text("funnel", exact=True)).first
    row.get_by_text("streamed by loader", exact=True).wait_for()
    assert row.get_by_text("79.8 %", exact=True).count() == 1
    matrix = page.locator("tr", has=page.get_by_text("tier_by_shape", exact=True)).first
    matrix.get_by_text("47 · 608x432").wait_for()  # a Markdown table, rendered inline
    page.locator("tr", has=page.get_by_text("funnel_chart", exact=True)).first \
        .get_by_text("[Show Markdown]").click()
    picture = page.get_by_role("dialog").locator(f'img[alt="{SOURCE} funnel"]')
    picture.wait_for()
    page.wait_for_function("i => i.complete && i.naturalWidth > 0", arg=picture.element_handle())
    assert picture.evaluate("i => i.naturalWidth") == 560
    screenshot(page, "dagster_funnel")
