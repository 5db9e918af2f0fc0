import numpy as np
import pytest

from prx_assets.stages.semantic.concepts import (
    balanced_selection,
    check_sizes,
    effective_sizes,
    hierarchical_kmeans,
    largest_to_median,
    leaf_budgets,
    size_histogram,
    water_fill,
)
from prx_assets.stages.semantic.synthetic import long_tailed_mixture


def test_water_fill_shares_evenly_and_gives_every_group_one():
    shares = water_fill(np.array([100, 10, 3, 1]), 30)
    assert shares.tolist() == [16, 10, 3, 1]
    assert water_fill(np.array([5, 5]), 100).tolist() == [5, 5]
    assert water_fill(np.array([50, 50, 50, 0]), 2).tolist() == [1, 1, 1, 0]


def test_levels_nest_each_cluster_has_one_parent():
    vectors, _ = long_tailed_mixture(topics=30, largest=500, seed=3)
    tree = hierarchical_kmeans(vectors, (24, 6, 2))
    assert len(tree.levels) == 3
    for level, parents in enumerate(tree.parents):
        assert np.array_equal(parents[tree.levels[level]], tree.levels[level + 1])
    assert tree.sizes(1).sum() == tree.sizes(3).sum() == len(vectors)
    assert (tree.sizes(3) > 0).sum() == 2


def test_balance_flattens_a_long_tail_ten_fold_and_keeps_every_cluster():
    vectors, _ = long_tailed_mixture(topics=60, largest=4000, seed=0)
    tree = hierarchical_kmeans(vectors, (60, 8))
    before = tree.sizes(1)
    keep = balanced_selection(tree, target=len(vectors) // 8)
    after = np.bincount(tree.leaves[keep], minlength=len(before))
    assert largest_to_median(before) >= 20  # the tail survives k-means
    assert largest_to_median(before) / largest_to_median(after) >= 10
    assert ((after >= 1) | (before == 0)).all()
    assert abs(int(keep.sum()) - len(vectors) // 8) <= len(before)  # >= 1 each may add
    assert (after <= before).all()


def test_budgets_follow_the_hierarchy_and_selection_is_seeded():
    vectors, _ = long_tailed_mixture(topics=20, largest=800, seed=4)
    tree = hierarchical_kmeans(vectors, (16, 4))
    budgets = leaf_budgets(tree, 400)
    assert 400 <= budgets.sum() <= 400 + 16
    first = balanced_selection(tree, 400, seed=1)
    assert np.array_equal(first, balanced_selection(tree, 400, seed=1))
    assert not np.array_equal(first, balanced_selection(tree, 400, seed=2))


def test_level_sizes_are_checked():
    assert check_sizes([100, 10]) == (100, 10)
    with pytest.raises(ValueError, match="levels"):
        check_sizes([100, 50, 20, 10, 5])
    with pytest.raises(ValueError, match="shrink"):
        check_sizes([10, 100])


def test_size_histogram_counts_every_non_empty_cluster():
    bins = size_histogram(np.array([1, 2, 3, 50, 0, 1000]))
    assert sum(count for _, _, count in bins) == 5


def test_levels_shrink_together_on_a_small_corpus():
    assert effective_sizes((64, 8), 280) == (17, 2)
    assert effective_sizes((64, 8), 10_000) == (64, 8)
    assert effective_sizes((64, 8, 2), 5) == (1, 1, 1)
    assert effective_sizes((4, 2), 9, min_rows_per_leaf=1) == (4, 2)
