"""The semantic skip reasons: `semdedup` from semantic_duplicates (non-kept copies), `balance`
from concepts (samples the balanced sample leaves out), both built-in names."""

import pyarrow as pa
import pytest

from prx_assets.stages.semantic.semdedup import SEMANTIC_DUPLICATES_SCHEMA
from prx_assets.stages.semantic.spaces import CONCEPTS_SCHEMA
from prx_assets.stages.skip_lists.skip_lists import (
    build_skip_lists,
    read_ablations,
    semantic_duplicate_ids,
    unbalanced_ids,
)
from prx_assets.storage.lance_tables import overwrite_rows
from prx_assets.storage.refs import TableRef
from prx_assets.storage.sidecars import applies_by_default


def test_semdedup_and_balance_ids_per_source(tmp_path):
    semantic = TableRef.of(tmp_path / "semantic_duplicates.lance")
    overwrite_rows(semantic, pa.Table.from_pylist([
        {"id": "web:a", "kept_id": "web:a", "group": 0, "group_size": 3, "cluster": 0,
         "similarity": 1.0, "applied": True},
        {"id": "web:b", "kept_id": "web:a", "group": 0, "group_size": 3, "cluster": 0,
         "similarity": 0.97, "applied": True},
        {"id": "stock:c", "kept_id": "web:a", "group": 0, "group_size": 3, "cluster": 0,
         "similarity": 0.96, "applied": True},
        {"id": "web:d", "kept_id": "web:e", "group": 1, "group_size": 2, "cluster": 0,
         "similarity": 0.99, "applied": False}], schema=SEMANTIC_DUPLICATES_SCHEMA),
        SEMANTIC_DUPLICATES_SCHEMA)
    # A group reported only (applied false, e.g. found in the caption space) skips nothing.
    assert semantic_duplicate_ids(semantic, "web") == {"web:b"}
    assert semantic_duplicate_ids(semantic, "stock") == {"stock:c"}
    assert semantic_duplicate_ids(TableRef.of(tmp_path / "absent.lance"), "web") == set()

    concepts = TableRef.of(tmp_path / "concepts.lance")
    rows = [{"id": i, "level": level, "cluster": 0, "balanced": kept}
            for i, kept in (("web:a", True), ("web:b", False), ("stock:c", False))
            for level in (1, 2)]
    overwrite_rows(concepts, pa.Table.from_pylist(rows, schema=CONCEPTS_SCHEMA),
                   CONCEPTS_SCHEMA)
    assert unbalanced_ids(concepts, "web") == {"web:b"}
    assert unbalanced_ids(TableRef.of(tmp_path / "absent.lance"), "web") == set()
    mapping = pa.record_batch({"id": ["web:a", "web:b"], "leaf": ["512/a", "512/a"],
                               "shard": ["shard.00000.mds"] * 2, "sample_index": [0, 1]})
    lists = build_skip_lists([mapping], {"semdedup": {"web:b"}, "balance": {"web:b"}})
    assert lists == {("512/a", "shard.00000.mds"): {"semdedup": [1], "balance": [1]}}
    assert applies_by_default("semdedup") and not applies_by_default("balance")


@pytest.mark.parametrize("name", ["semdedup", "balance"])
def test_ablations_cannot_take_the_semantic_reason_names(tmp_path, name):
    (tmp_path / f"{name}.txt").write_text("web:a\n")
    with pytest.raises(ValueError, match="built-in reason"):
        read_ablations(tmp_path)
