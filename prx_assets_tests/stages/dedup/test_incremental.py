"""Incremental exact duplicates equal a full recompute on the same rows: groups joined,
grown, split and dissolved by new, re-hashed and deleted rows across sources."""

import numpy as np
import pyarrow as pa

from prx_assets.stages.dedup.dedup import (
    DUPLICATES_SCHEMA,
    NOT_FLAT,
    group_candidates,
    hash_inputs,
)
from prx_assets.stages.dedup.incremental import (
    candidates_with_hashes,
    incremental_duplicates,
    record_inputs,
    sources_changed,
)
from prx_assets.stages.images.stage import PHASH_SCHEMA
from prx_assets.storage.changes import groups_changed_at
from prx_assets.storage.lance_tables import append_rows, overwrite_rows, upsert
from prx_assets.storage.layout import Storage

SOURCES = ["web", "stock", "books"]


def hash_rows(source: str, hashes: list[int], start: int = 0, flat: int | None = None
              ) -> pa.Table:
    n = len(hashes)
    return pa.table({"id": [f"{source}:{start + i:04d}" for i in range(n)],
                     "phash": pa.array(hashes, pa.int64()),
                     "pixels": pa.array([(start + i) % 5 * 1000 for i in range(n)], pa.int64()),
                     "flat": [flat == i for i in range(n)]}, schema=PHASH_SCHEMA)


def full_recompute(storage: Storage) -> pa.Table:
    inputs, _ = hash_inputs(storage, SOURCES)
    everything = candidates_with_hashes(inputs, np.unique(np.concatenate([
        i.open().to_table(columns=["phash"], filter=NOT_FLAT).column("phash").to_numpy()
        for i in inputs])))
    return group_candidates(everything)


def as_set(table: pa.Table) -> set:
    return {tuple(r.values()) for r in table.select(DUPLICATES_SCHEMA.names).to_pylist()}


def test_an_update_from_the_changes_equals_the_full_recompute(tmp_path):
    storage = Storage(tmp_path)
    rng = np.random.default_rng(0)
    base = rng.integers(1, 10**12, size=40).tolist()
    for k, source in enumerate(SOURCES):  # groups of two and three across sources
        hashes = base[:10] + rng.integers(1, 10**12, size=20).tolist()
        if k == 2:
            hashes[:5] = base[20:25]
        append_rows(storage.table("phashes", source), hash_rows(source, hashes), PHASH_SCHEMA)
    target = storage.table("duplicates")
    inputs, _ = hash_inputs(storage, SOURCES)
    overwrite_rows(target, full_recompute(storage), DUPLICATES_SCHEMA)
    record_inputs(target, inputs)
    before = target.open().to_table()

    web = storage.table("phashes", "web").open().to_table().column("phash").to_pylist()
    stock = storage.table("phashes", "stock").open().to_table().column("phash").to_pylist()
    # web: a copy of a singleton of stock (a new group), a copy of a group, a new pair, a
    # flat row with a grouped hash (ignored); stock: one grouped row re-hashed (its group
    # shrinks), one deleted (another group shrinks).
    append_rows(storage.table("phashes", "web"), hash_rows(
        "web", [stock[15], web[3], 777, 777, web[4]], start=100, flat=4), PHASH_SCHEMA)
    upsert(storage.table("phashes", "stock"), hash_rows("stock", [999], start=5),
           PHASH_SCHEMA, ["id"])
    storage.table("phashes", "stock").open().delete("id = 'stock:0006'")

    inputs, _ = hash_inputs(storage, SOURCES)
    result = incremental_duplicates(inputs, target)
    assert result is not None
    assert result.hashes >= 5 and result.rows_rewritten < before.num_rows
    after = target.open().to_table()
    assert as_set(after) == as_set(full_recompute(storage))
    assert as_set(after) != as_set(before)
    kept = {r["id"]: r["kept_id"] for r in after.to_pylist()}
    assert kept["web:0100"] in {"web:0100", "stock:0015"} and "web:0104" not in kept
    assert "web:0102" in kept and kept["web:0102"] == kept["web:0103"]

    # Nothing changed since: nothing rewritten, no new version.
    latest = target.open().version
    again = incremental_duplicates(hash_inputs(storage, SOURCES)[0], target)
    assert again is not None and again.hashes == 0
    assert again.version == target.open().version == latest


def test_without_a_record_or_with_the_sources_reordered_a_full_run_is_needed(tmp_path):
    storage = Storage(tmp_path)
    for source in SOURCES:
        append_rows(storage.table("phashes", source), hash_rows(source, [1, 2, 3]),
                    PHASH_SCHEMA)
    target = storage.table("duplicates")
    inputs, _ = hash_inputs(storage, SOURCES)
    assert incremental_duplicates(inputs, target) is None  # no table
    overwrite_rows(target, full_recompute(storage), DUPLICATES_SCHEMA)
    assert incremental_duplicates(inputs, target) is None  # no record
    record_inputs(target, inputs)
    assert incremental_duplicates(inputs, target) is not None
    assert incremental_duplicates(hash_inputs(storage, SOURCES[::-1])[0], target) is None
    # Most rows new: a full pass costs about as much.
    append_rows(storage.table("phashes", "web"), hash_rows("web", list(range(10, 40)), 50),
                PHASH_SCHEMA)
    assert incremental_duplicates(hash_inputs(storage, SOURCES)[0], target) is None


def test_an_update_records_the_sources_whose_groups_changed_and_only_those(tmp_path):
    """The per-source signal the factory starts skip lists by: a new row joining no group
    changes no source; one copying another source's image changes both."""
    storage = Storage(tmp_path)
    for k, source in enumerate(SOURCES):
        append_rows(storage.table("phashes", source),
                    hash_rows(source, [100 + k, 200 + k, 7, 7]), PHASH_SCHEMA)
    target = storage.table("duplicates")
    inputs, _ = hash_inputs(storage, SOURCES)
    overwrite_rows(target, full_recompute(storage), DUPLICATES_SCHEMA)
    record_inputs(target, inputs)
    assert groups_changed_at(target) == {}

    append_rows(storage.table("phashes", "web"), hash_rows("web", [555], start=10),
                PHASH_SCHEMA)
    alone = incremental_duplicates(hash_inputs(storage, SOURCES)[0], target)
    assert alone is not None and alone.sources_changed == ()
    assert groups_changed_at(target) == {}

    append_rows(storage.table("phashes", "web"), hash_rows("web", [201], start=20),
                PHASH_SCHEMA)
    copy = incremental_duplicates(hash_inputs(storage, SOURCES)[0], target)
    assert copy is not None and copy.sources_changed == ("stock", "web")
    assert groups_changed_at(target) == {"stock": copy.version, "web": copy.version}
    assert as_set(target.open().to_table()) == as_set(full_recompute(storage))


def test_sources_changed_compares_the_rows_of_each_source():
    row = {"id": "web:1", "kept_id": "web:1", "phash": 7, "group_size": 2}
    before = pa.Table.from_pylist([row, {**row, "id": "stock:1"}], DUPLICATES_SCHEMA)
    grown = pa.Table.from_pylist([{**row, "group_size": 3}, {**row, "id": "stock:1",
                                                              "group_size": 3},
                                  {**row, "id": "books:1", "group_size": 3}],
                                 DUPLICATES_SCHEMA)
    assert sources_changed(before, before) == []
    assert sources_changed(before, grown) == ["books", "stock", "web"]
    assert sources_changed(before, before.slice(0, 1)) == ["stock"]


def test_the_touched_hashes_are_found_by_lance_in_scans_of_a_bounded_filter(
        tmp_path, monkeypatch):
    """The hashes go into the scan's filter (Lance reads ids and pixels of the matches
    only), at most `hashes_per_scan` of them a scan; the rows found are the same."""
    import lance

    storage = Storage(tmp_path)
    for k, source in enumerate(SOURCES):
        append_rows(storage.table("phashes", source),
                    hash_rows(source, [1, 2, 3, 10 + k], flat=2), PHASH_SCHEMA)
    inputs, _ = hash_inputs(storage, SOURCES)
    filters = []
    to_table = lance.LanceDataset.to_table
    monkeypatch.setattr(lance.LanceDataset, "to_table", lambda self, *a, **kw: (
        filters.append(kw.get("filter")), to_table(self, *a, **kw))[1])
    found = candidates_with_hashes(inputs, np.array([1, 3, 11, 99]), hashes_per_scan=3)
    assert sorted(zip(found.column("id").to_pylist(), found.column("rank").to_pylist(),
                      strict=True)) == [("books:0000", 2), ("stock:0000", 1),
                                        ("stock:0003", 1), ("web:0000", 0)]
    assert len(filters) == 2 * len(SOURCES)  # 4 hashes, 3 a scan: two scans a source
    assert all("phash IN (1, 3, 11)" in f or "phash IN (99)" in f for f in filters)


def test_the_inputs_are_recorded_in_one_commit(tmp_path):
    storage = Storage(tmp_path)
    for source in SOURCES:
        append_rows(storage.table("phashes", source), hash_rows(source, [1, 2]), PHASH_SCHEMA)
    target = storage.table("duplicates")
    overwrite_rows(target, DUPLICATES_SCHEMA.empty_table(), DUPLICATES_SCHEMA)
    before = target.latest_version()
    record_inputs(target, hash_inputs(storage, SOURCES)[0])
    assert target.latest_version() == before + 1
