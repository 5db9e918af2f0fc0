"""The driver's planning structures stay in Arrow: the same leaves, parts and mapping rows
as the per-row Python it replaced, without a Python object per sample."""

import pickle

import numpy as np
import pyarrow as pa

from prx_assets.stages.shards import mapping, parts, plan
from prx_assets.storage.refs import Location, TableRef

KEYS = [(256, 256, 256)] * 3 + [(512, 384, 512)] * 2 + [(512, 512, 384)] + [(1024, 1024, 1024)] * 4


def _plan(keys=KEYS) -> pa.Table:
    n = len(keys)
    tier, width, height = (pa.array([k[i] for k in keys], pa.int32()) for i in range(3))
    return pa.table({"id": [f"s:{i:03d}" for i in range(n)], "tier": tier, "width": width,
                     "height": height, "image_row": pa.array(range(n), pa.uint64()),
                     "caption_row": pa.array(range(n), pa.uint64()),
                     "fingerprint": pa.array(range(n), pa.int64())})


def _leaves_by_python(table: pa.Table) -> list[tuple[tuple[int, int, int], list[str]]]:
    """The per-row grouping `split_leaves` did before, as a reference."""
    out: list[tuple[tuple[int, int, int], list[str]]] = []
    for row in table.to_pylist():
        key = (row["tier"], row["width"], row["height"])
        if not out or out[-1][0] != key:
            out.append((key, []))
        out[-1][1].append(row["id"])
    return out


def test_leaves_are_cut_where_the_key_changes():
    table = _plan()
    leaves = plan.split_leaves(table)
    assert [(key, rows["id"].to_pylist()) for key, rows in leaves] == _leaves_by_python(table)
    assert all(type(v) is int for key, _ in leaves for v in key)  # json-safe: no numpy ints
    one = plan.split_leaves(_plan(KEYS[:1]))
    assert [(key, rows.num_rows) for key, rows in one] == [((256, 256, 256), 1)]
    assert plan.split_leaves(_plan([])) == []


def test_a_key_change_in_any_one_column_starts_a_leaf():
    keys = [(512, 384, 512), (512, 512, 512), (512, 512, 384), (1024, 512, 384)]
    assert len(plan.split_leaves(_plan(keys))) == 4


def test_part_ids_are_arrow_and_pickle_only_their_own_rows():
    table = _plan(KEYS * 200)
    specs = parts.part_specs(table, Location.of("/tmp/leaf"), rows_per_part=100)
    assert [len(spec.ids) for spec in specs] == [100] * 20
    assert isinstance(specs[3].ids, pa.Array)
    assert specs[3].ids.to_pylist() == table["id"].to_pylist()[300:400]
    # A task receives its part's ids, not the whole plan's buffer.
    assert len(pickle.dumps(specs[3].ids)) < 4 * 100 * len("s:000")


def test_mapping_rows_name_each_samples_shard_and_position():
    leaf_rows = _plan(KEYS[:5]).slice(0, 5)
    shards = [{"samples": 3, "raw_data": {"basename": "shard.00007.mds"}},
              {"samples": 2, "raw_data": {"basename": "shard.00008.mds"}}]
    rows = mapping.mapping_rows("web", (256, 256, 256), leaf_rows, shards, "t1")
    assert rows.schema == mapping.MDS_SAMPLES_SCHEMA
    assert rows["shard"].to_pylist() == ["shard.00007.mds"] * 3 + ["shard.00008.mds"] * 2
    assert rows["sample_index"].to_pylist() == [0, 1, 2, 0, 1]
    assert set(rows["source"].to_pylist()) == {"web"}
    assert set(rows["leaf"].to_pylist()) == {"256/256x256"}
    assert set(rows["tree_version"].to_pylist()) == {"t1"}
    empty = mapping.mapping_rows("web", (256, 256, 256), leaf_rows.slice(0, 0), [], "t1")
    assert empty.num_rows == 0 and empty.schema == mapping.MDS_SAMPLES_SCHEMA


def test_leaf_counts_and_versions_stream_over_batches(tmp_path):
    import lance

    rows = pa.table({"leaf": ["a", "b", "a", "c", "a"], "tree_version": ["t1", "t1", "t2",
                                                                      "t1", "t1"]})
    lance.write_dataset(rows, tmp_path / "m.lance")
    per_leaf, versions = mapping.mapped_leaves(TableRef.of(tmp_path / "m.lance"), batch_rows=2)
    assert per_leaf == {"a": 3, "b": 1, "c": 1}
    assert versions == {"t1", "t2"}
    assert np.sum(list(per_leaf.values())) == rows.num_rows


def test_leaf_counts_rescan_only_the_fragments_written_or_deleted_from(tmp_path, monkeypatch):
    import lance

    def rows(leaf: str, version: str, n: int) -> pa.Table:
        return pa.table({"id": [f"{leaf}{version}{i}" for i in range(n)], "leaf": [leaf] * n,
                         "tree_version": [version] * n})

    path, cache = tmp_path / "m.lance", Location.of(tmp_path / "counts.json")
    lance.write_dataset(rows("a", "t1", 3), path)
    lance.write_dataset(rows("b", "t1", 2), path, mode="append")
    table = TableRef.of(path)
    scanned: list[int] = []
    count_fragment = mapping.count_fragment

    def counting(dataset, fragment, batch_rows):
        scanned.append(fragment.fragment_id)
        return count_fragment(dataset, fragment, batch_rows)

    monkeypatch.setattr(mapping, "count_fragment", counting)
    assert mapping.mapped_leaves(table, cache=cache) == ({"a": 3, "b": 2}, {"t1"})
    assert sorted(scanned) == [0, 1]
    lance.dataset(path).delete("id = 'at10'")  # a run's stale sample, and its new rows
    lance.write_dataset(rows("c", "t2", 2), path, mode="append")
    scanned.clear()
    assert mapping.mapped_leaves(table, cache=cache) == ({"a": 2, "b": 2, "c": 2},
                                                         {"t1", "t2"})
    assert sorted(scanned) == [0, 2]  # fragment 1 unchanged: its counts kept
    assert mapping.mapped_leaves(table, cache=cache) == mapping.mapped_leaves(table)
    cache.write_text("{not json")  # unreadable: every fragment counted again
    scanned.clear()
    assert mapping.mapped_leaves(table, cache=cache)[0] == {"a": 2, "b": 2, "c": 2}
    assert sorted(scanned) == [0, 1, 2]


def test_leaf_counts_stay_true_when_an_older_runs_counts_land_last(tmp_path):
    import lance

    path, cache = tmp_path / "m.lance", Location.of(tmp_path / "counts.json")
    lance.write_dataset(pa.table({"id": ["a0", "a1"], "leaf": ["a", "a"],
                                  "tree_version": ["t1", "t1"]}), path)
    table = TableRef.of(path)
    old = table.pinned()
    lance.dataset(path).delete("id = 'a1'")  # the same fragment, fewer live rows
    newer = table.pinned()
    assert mapping.mapped_leaves(newer, cache=cache)[0] == {"a": 1}
    # A check of the older version finishing last writes its counts over the newer ones.
    assert mapping.mapped_leaves(old, cache=cache)[0] == {"a": 2}
    assert mapping.mapped_leaves(newer, cache=cache)[0] == {"a": 1}
