"""A tree card's skip lines say which lists are opt-in."""

from prx_assets.stages.shards.card import skip_line


def test_skip_lines_mark_the_opt_in_lists():
    assert skip_line("dedup", 1234) == "- dedup: 1,234"
    assert skip_line("balance", 45) == (
        "- balance: 45 (opt-in list: skipped only when a run names it)")
    assert skip_line("no_blue", 3).endswith("(opt-in list: skipped only when a run names it)")
