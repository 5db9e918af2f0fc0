import itertools
import math

import pytest

from prx_assets.stages.images.buckets import (
    DEFAULT_TIERS,
    BucketRule,
    Shape,
    aspect_ratios,
    assign_bucket,
    choose_tier,
    tier_shapes,
)


@pytest.mark.parametrize("tier", DEFAULT_TIERS)
def test_each_tier_has_13_aligned_shapes_with_flat_area(tier):
    shapes = tier_shapes(tier)
    assert len(shapes) == 13
    assert all(s.width % 16 == 0 and s.height % 16 == 0 for s in shapes)
    assert all(abs(s.width * s.height / tier**2 - 1) < 0.03 for s in shapes)
    assert Shape(tier, tier) in shapes  # aspect 1.0 exactly
    aspects = [s.aspect for s in shapes]
    assert aspects == sorted(aspects)
    assert aspects[0] == pytest.approx(0.5, rel=0.03)
    assert aspects[-1] == pytest.approx(2.0, rel=0.03)
    assert [Shape(s.height, s.width) for s in reversed(shapes)] == list(shapes)  # transposes


def test_ratios_are_geometric_with_one_in_the_middle():
    ratios = aspect_ratios()
    assert ratios[6] == pytest.approx(1.0)
    steps = {round(b / a, 9) for a, b in itertools.pairwise(ratios)}
    assert len(steps) == 1 and math.isclose(steps.pop(), 2 ** (1 / 6), rel_tol=1e-9)


def test_alignment_is_configurable():
    assert all(s.width % 64 == 0 and s.height % 64 == 0 for s in tier_shapes(1024, alignment=64))


@pytest.mark.parametrize("size, tier", [
    ((384, 384), 512),        # the floor: 512 reached by upscaling exactly 4/3
    ((767, 767), 512),        # just short of (3/4 * 1024)^2
    ((768, 768), 1024),
    ((1024, 1024), 1024),
    ((1600, 1200), 1024),     # 1.92 MP < 1536^2
    ((1536, 1536), 2048),
    ((4000, 3000), 4096),     # 12 MP >= 3072^2: upscaled by 1.18 at most
    ((3000, 3000), 2048),
    ((10000, 8000), 4096),    # above the largest tier: downscaled
])
def test_tier_is_the_largest_reached_without_upscaling_more_than_four_thirds(size, tier):
    assert choose_tier(*size) == tier


@pytest.mark.parametrize("size, expected", [
    ((383, 383), ("too_small", None, None)),
    ((1000, 100), ("too_small", None, None)),    # size is checked before aspect
    ((3000, 1000), ("bad_aspect", None, None)),
    ((400, 1000), ("bad_aspect", None, None)),     # 0.4 < 0.5
    ((1000, 500), ("ok", 512, Shape(720, 368))),   # 2.0 exactly: the widest shape
    ((1920, 1080), ("ok", 1024, Shape(1360, 768))),  # 16:9 -> nearest in log space
    ((1080, 1920), ("ok", 1024, Shape(768, 1360))),
    ((3000, 2000), ("ok", 2048, Shape(2576, 1632))),  # 1.5 vs shapes 1.41 / 1.58
    ((600, 600), ("ok", 512, Shape(512, 512))),
])
def test_hand_worked_examples(size, expected):
    bucket = assign_bucket(*size)
    assert (bucket.status, bucket.tier, bucket.shape) == expected


def test_rule_is_configurable():
    rule = BucketRule(tiers=(256, 512), min_aspect=0.25, max_aspect=4.0, shapes_per_tier=9)
    assert assign_bucket(200, 200, rule).tier == 256
    assert assign_bucket(1000, 300, rule).status == "ok"
