"""Attribute facets of the grid: parsed from the URL against the schema, as a filter over
corpus rows, and counted (values, and "at least N" for the qualities)."""

import pyarrow as pa
import pytest

from prx_assets.browser.catalog import BadQuery
from prx_assets.browser.facets import Query, attribute_facets, corpus_filter

ROWS = pa.table({
    "id": ["a", "b", "c", "d"],
    "medium": ["photo", "photo", "painting", None],
    "watermark": [False, True, False, None],
    "aesthetic_quality": pa.array([5, 3, 4, None], pa.int8()),
})


def test_attribute_facets_filter_the_rows():
    query = Query.parse({"medium": "photo", "watermark": "false",
                         "aesthetic_quality_min": "4"})
    assert query.filtered and query.params()["aesthetic_quality_min"] == "4"
    assert ROWS.filter(corpus_filter(query, None)).column("id").to_pylist() == ["a"]
    loose = Query.parse({"aesthetic_quality_min": "3"})
    assert ROWS.filter(corpus_filter(loose, None)).column("id").to_pylist() == ["a", "b", "c"]


def test_unknown_chooses_the_rows_that_do_not_know_the_attribute_never_a_no():
    unknown = Query.parse({"watermark": "unknown"})
    assert ROWS.filter(corpus_filter(unknown, None)).column("id").to_pylist() == ["d"]
    no = Query.parse({"watermark": "false"})
    assert ROWS.filter(corpus_filter(no, None)).column("id").to_pylist() == ["a", "c"]


def test_attribute_values_are_checked_against_the_schema():
    with pytest.raises(BadQuery, match="medium"):
        Query.parse({"medium": "hologram"})
    with pytest.raises(BadQuery, match="1 to 5"):
        Query.parse({"aesthetic_quality_min": "9"})


def test_attribute_facets_are_counted_with_cumulative_quality_ranges():
    facets = attribute_facets(ROWS)
    # A null is counted as unknown, apart from the values (never as "no").
    assert facets["medium"] == [("photo", 2), ("painting", 1), ("unknown", 1)]
    assert facets["watermark"] == [("false", 2), ("true", 1), ("unknown", 1)]
    assert facets["aesthetic_quality_min"] == [("5", 1), ("4", 2), ("3", 3), ("2", 3),
                                               ("1", 3)]
