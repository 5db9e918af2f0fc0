"""Numbers for people: sizes, shares, durations, bar charts and the tier × shape matrix."""

from prx_assets.stages.report.charts import (
    INLINE_MARKDOWN_CHARS,
    bar,
    bar_chart_markdown,
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


def test_a_bar_is_block_characters_in_eighths():
    assert bar(10, 10, 4) == "████"
    assert bar(5, 10, 4) == "██"
    assert bar(1, 10, 4) == "▍"  # 3.2 eighths -> 3
    assert bar(0, 10, 4) == "" and bar(3, 0, 4) == ""


def test_a_bar_chart_is_markdown_short_enough_for_the_ui_to_draw_inline():
    chart = bar_chart_markdown(["raw", "kept", "in shards"], [124, 107, 0],
                               "where the images go", ["124 (100 %)", "107 (86 %)", "0 (0 %)"])
    assert "124\u00a0(100\u00a0%)" in chart  # a value never breaks across lines
    assert chart.replace("\u00a0", " ").splitlines() == [
        "**where the images go**", "", "| | | |", "| --- | ---: | --- |",
        f"| raw | 124 (100 %) | {'█' * 12} |",
        f"| kept | 107 (86 %) | {'█' * 10}▍ |",  # 82.8 eighths
        "| in shards | 0 (0 %) |  |"]
    assert png_markdown(b"\x89PNG", "x") == "![x](data:image/png;base64,iVBORw==)"


def test_a_long_chart_narrows_its_bars_then_counts_the_rows_left_out():
    labels = [f"a long band label {i}" for i in range(40)]
    chart = bar_chart_markdown(labels, list(range(40)), "forty bands")
    assert len(chart) < INLINE_MARKDOWN_CHARS
    rows = chart.splitlines()
    assert rows[-1].startswith("| … ") and rows[-1].endswith(" more | | |")
    shown = len(rows) - 5
    assert rows[-1] == f"| … {40 - shown} more | | |"
    narrow = bar_chart_markdown(labels[:24], [5] * 24, "twenty-four")
    assert len(narrow) < INLINE_MARKDOWN_CHARS and "more" not in narrow
    assert max(len(r.split("|")[3].strip()) for r in narrow.splitlines()[4:]) < 12


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
