"""The global growth bench's scoring: pairs of rows sharing a group, and ids to rows."""

import numpy as np
import pyarrow as pa

from bench.global_growth import pair_scores, parse_sizes, row_id, rows_of


def test_pair_scores_count_pairs_of_rows_sharing_a_group():
    truth = np.array([0, 0, 0, 1, 1, -1, -1])  # pairs: 3 + 1
    found = np.array([5, 5, -1, 7, 7, 9, 9])  # pairs: (0,1) and (3,4) true, (5,6) false
    recall, precision = pair_scores(found, truth)
    assert (recall, precision) == (2 / 4, 2 / 3)
    assert pair_scores(truth, truth) == (1.0, 1.0)
    assert pair_scores(np.full(7, -1), truth) == (0.0, 0.0)


def test_ids_name_their_rows_and_sizes_parse():
    ids = pa.array([row_id("s2", 12), row_id("s0", 0), row_id("s3", 10**9)])
    assert rows_of(ids).tolist() == [12, 0, 10**9]
    assert parse_sizes("1e5,1e6, 2000") == [2000, 100_000, 1_000_000]
