"""A tree card's skip lines say which lists are opt-in."""

from prx_assets.stages.shards.card import skip_line


def test_skip_lines_mark_the_opt_in_lists():
    assert skip_line("dedup", 1234) == "- dedup: 1,234"
    assert skip_line("balance", 45) == (
        "- balance: 45 (opt-in list: skipped only when a run names it)")
    assert skip_line("no_blue", 3).endswith("(opt-in list: skipped only when a run names it)")


def test_the_card_counts_licenses_attribution_and_reservations(tmp_path):
    import pyarrow as pa

    from prx_assets.stages.shards.card import (
        CardFacts,
        attribution_required,
        build_card,
        provenance_counts,
    )
    from prx_assets.storage.lance_tables import overwrite_rows
    from prx_assets.storage.layout import Storage
    from prx_assets.storage.tables import RAW_IMAGES

    storage = Storage(str(tmp_path))
    rows = pa.table({"id": ["w:1", "w:2", "w:3", "w:4"],
                     "license": ["cc-by-4.0", "cc-by-4.0", "cc0", "cc-by-sa-4.0"],
                     "reservation": ["none", "prohibited", "none", "constrained"]})
    overwrite_rows(storage.table(RAW_IMAGES, "w"), rows, rows.schema)
    counts = provenance_counts(storage, {"w": pa.array(["w:1", "w:2", "w:3"])})
    assert counts == {"license": {"cc-by-4.0": 2, "cc0": 1},
                      "reservation": {"none": 2, "prohibited": 1},
                      "attribution_required": {"cc-by-4.0": 2}}
    assert attribution_required("CC BY-SA 4.0") and not attribution_required("cc0")
    card, markdown = build_card(CardFacts(kind="source", name="w", tree_version="v",
                                          uri="u", licenses={"w": "cc0"}, leaves={},
                                          provenance=counts))
    assert card["reservations"]["prohibited"] == {"count": 1, "share": 0.3333}
    assert card["attribution_required"] == {"cc-by-4.0": {"count": 2, "share": 1.0}}
    assert "| cc-by-4.0 | 2 | required |" in markdown and "prohibited: 1" in markdown
