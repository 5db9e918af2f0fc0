"""`prx-assets search --attr ...`: conditions parsed against the schema, evaluated on the
attributes tables, unknown fields and values refused with what exists."""

import pytest

from prx_assets.cli import main as cli
from prx_assets.stages.corpus.attribute_filters import AttributeFilterError, AttributeWhere
from prx_assets.stages.subsets.definition import Range
from prx_assets.testing.subset_corpus import subset_corpus


def test_conditions_parse_against_the_schema():
    where = AttributeWhere.parse(["medium=photo,painting", "people=1..3", "watermark=false",
                                  "aesthetic_quality=4..", "subjects=person"])
    assert where is not None
    assert where.conditions == {"medium": ("photo", "painting"), "people": Range(1, 3),
                                "watermark": (False,), "aesthetic_quality": Range(4, None),
                                "subjects": ("person",)}
    assert AttributeWhere.parse([]) is None
    for bad, message in [("mood=calm", "unknown attribute"), ("medium", "NAME=VALUE"),
                         ("medium=sculpture", "not among"), ("watermark=maybe", "true or")]:
        with pytest.raises(AttributeFilterError, match=message):
            AttributeWhere.parse([bad])


def test_matching_ids_come_from_the_attributes_tables(tmp_path, capsys):
    with subset_corpus(tmp_path) as corpus:
        where = AttributeWhere.parse(["medium=painting", "people=0..1"])
        assert where is not None
        ids = sorted(where.matching_ids(corpus["storage"]).to_pylist())
        # index 0 (people 0) and 3 (people 3) are paintings: index 0 of each leaf
        assert ids == sorted(f"{s}:{t}-{w}x{w}-0000" for s in ("alpha", "beta")
                             for t, w in ((1, 64), (2, 96)))
        assert cli(["search", "a picture", "--attr", "mood=calm"]) == 2
        assert "unknown attribute" in capsys.readouterr().err
