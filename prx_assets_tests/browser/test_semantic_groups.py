"""The duplicates page's semantic groups: read from semantic_duplicates, largest first."""

import pyarrow as pa

from prx_assets.browser.catalog import Catalog
from prx_assets.browser.duplicates import semantic_groups
from prx_assets.stages.semantic.semdedup import SEMANTIC_DUPLICATES_SCHEMA
from prx_assets.storage.lance_tables import overwrite_rows
from prx_assets.storage.layout import Storage


def _row(sample_id: str, kept_id: str, size: int, similarity: float = 0.97) -> dict:
    return {"id": sample_id, "kept_id": kept_id, "group": 0, "group_size": size,
            "cluster": 0, "similarity": similarity, "applied": True}


def test_semantic_groups_page_largest_first_kept_copy_leading(tmp_path):
    store = Storage(tmp_path)
    assert semantic_groups(Catalog(store)) == ([], 0)
    rows = [_row("web:b", "web:b", 2, 1.0), _row("stock:c", "web:b", 2),
            _row("web:x", "web:y", 3), _row("web:y", "web:y", 3, 1.0),
            _row("stock:z", "web:y", 3, 0.955)]
    overwrite_rows(store.table("semantic_duplicates"),
                   pa.Table.from_pylist(rows, schema=SEMANTIC_DUPLICATES_SCHEMA),
                   SEMANTIC_DUPLICATES_SCHEMA)
    groups, total = semantic_groups(Catalog(store))
    assert total == 2
    assert [[m["id"] for m in g.members] for g in groups] == [
        ["web:y", "stock:z", "web:x"], ["web:b", "stock:c"]]
    assert groups[0].members[0]["kept"] and not groups[0].members[1]["kept"]
    assert groups[0].members[1]["similarity"] == 0.955
    second_page, _ = semantic_groups(Catalog(store), page=1, per_page=1)
    assert [m["id"] for m in second_page[0].members] == ["web:b", "stock:c"]
