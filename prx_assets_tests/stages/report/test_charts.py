"""Numbers for people: sizes, shares, durations, bar charts and the tier × shape matrix."""

import io

from PIL import Image

from prx_assets.stages.report.charts import (
    CHART_WIDTH_PX,
    bar_chart_png,
    human_bytes,
    human_duration,
    percent,
    png_markdown,
    tier_shape_markdown,
)


def test_sizes_shares_and_durations_read_as_words():
    assert human_bytes(23544848) == "23.5 MB"
    assert (human_bytes(999), human_bytes(1000), human_bytes(3.2e12)) == ("999 B", "1.0 KB",
                                                                          "3.2 TB")
    assert percent(0.8421) == "84.2 %" and percent(1.0, 0) == "100 %"
    assert (human_duration(4.25), human_duration(75), human_duration(3725)) == (
        "4.2 s", "1 min 15 s", "1 h 2 min")


def test_a_bar_chart_is_a_small_png_with_a_bar_per_label():
    png = bar_chart_png(["raw", "kept", "in shards"], [124, 107, 0], "where the images go",
                        ["124 (100 %)", "107 (86 %)", "0 (0 %)"])
    image = Image.open(io.BytesIO(png))
    assert image.format == "PNG" and image.width == CHART_WIDTH_PX
    assert len(png) < 40_000
    taller = Image.open(io.BytesIO(bar_chart_png([str(i) for i in range(9)], list(range(9)),
                                                 "nine")))
    assert taller.height > image.height  # a row per label
    assert png_markdown(b"\x89PNG", "x") == "![x](data:image/png;base64,iVBORw==)"


def test_the_tier_by_shape_matrix_has_a_row_per_tier_and_a_column_per_aspect():
    table = tier_shape_markdown({(512, "512x512"): 3, (512, "608x432"): 5,
                                 (1024, "1024x1024"): 2, (1024, "1216x864"): 1,
                                 (512, "432x608"): 1})
    assert table.splitlines() == [
        "| tier | w/h 0.71 | w/h 1 | w/h 1.41 | total |",
        "| --- | --- | --- | --- | --- |",
        "| 512 | 1 · 432x608 | 3 · 512x512 | 5 · 608x432 | 9 |",
        "| 1024 |  | 2 · 1024x1024 | 1 · 1216x864 | 3 |",
    ]
    assert tier_shape_markdown({}) == "_no kept images_"
