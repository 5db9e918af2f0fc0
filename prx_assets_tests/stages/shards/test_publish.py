"""The mapping kept after each publish (`publish.maintain_mapping`): months of incremental
runs leave it a few fragments, all indexed; the files of a killed build's staged fragments
are freed once a week old, never those of a build that may still be running; an
incremental build that compacts the mapping reports the compacted version and verifies."""

import os
import time
from pathlib import Path

import pyarrow as pa

from prx_assets.stages.shards import mds, publish, verify
from prx_assets.stages.shards.mapping import (
    MDS_SAMPLES_SCHEMA,
    stage_fragments,
    update_mapping,
)
from prx_assets.storage.key_index import KeyIndexPolicy, key_index_stats
from prx_assets.storage.lance_tables import overwrite_rows
from prx_assets.storage.layout import Storage
from prx_assets.storage.refs import TableRef
from prx_assets.testing.mds_corpus import NEW_ID, add_sample, build_corpus, inputs_for
from prx_assets.testing.mds_corpus import WRITE_OPTIONS as OPTIONS

INDEXED = KeyIndexPolicy(min_rows=1)
WEEK_AND_A_DAY_S = 8 * 24 * 3600


def rows(ids: list[str], fingerprint: int = 0) -> pa.Table:
    n = len(ids)
    return pa.table({
        "id": ids, "source": ["web"] * n, "tier": pa.array([512] * n, pa.int32()),
        "width": pa.array([512] * n, pa.int32()), "height": pa.array([512] * n, pa.int32()),
        "leaf": ["512/512x512"] * n, "shard": ["shard.00000.mds"] * n,
        "sample_index": pa.array(range(n), pa.int64()), "tree_version": ["v"] * n,
        "fingerprint": pa.array([fingerprint] * n, pa.int64()),
    }, schema=MDS_SAMPLES_SCHEMA)


def data_files(table: TableRef) -> set[str]:
    return {p.name for p in (Path(table.uri) / "data").iterdir()}


def test_many_incremental_runs_leave_the_mapping_a_few_indexed_fragments(tmp_path):
    mapping = TableRef.of(tmp_path / "mds_samples.lance")
    overwrite_rows(mapping, rows([f"web:{i:05d}" for i in range(200)]), MDS_SAMPLES_SCHEMA)
    live = {f"web:{i:05d}": 0 for i in range(200)}
    compacted = 0
    for run in range(1, 41):
        new = [f"web:new-{run:03d}-{i}" for i in range(3)]
        changed, gone = f"web:{run:05d}", f"web:{100 + run:05d}"
        update_mapping(mapping, rows([*new, changed], fingerprint=run), [gone])
        live.update(dict.fromkeys([*new, changed], run))
        del live[gone]
        before = len(mapping.latest().open().get_fragments())
        assert publish.maintain_mapping(mapping, INDEXED)  # every run indexes its rows
        table = mapping.latest().open()
        compacted += len(table.get_fragments()) < before
        assert len(table.get_fragments()) <= publish.MAPPING_SMALL_FRAGMENTS
        assert key_index_stats(table, "id")["num_unindexed_rows"] == 0
    assert compacted >= 2  # forty runs: compacted every dozen or so, not every run
    assert compacted <= 40 // (publish.MAPPING_SMALL_FRAGMENTS // 2)
    found = mapping.latest().to_table(columns=["id", "fingerprint"]).to_pylist()
    assert {r["id"]: r["fingerprint"] for r in found} == live and len(found) == len(live)


def test_a_killed_builds_staged_files_are_freed_once_a_week_old_not_before(tmp_path):
    mapping = TableRef.of(tmp_path / "mds_samples.lance")
    overwrite_rows(mapping, rows(["web:a", "web:b"]), MDS_SAMPLES_SCHEMA)
    committed = data_files(mapping)
    stage_fragments(mapping, rows(["web:killed"]))
    killed = data_files(mapping) - committed
    past = time.time() - WEEK_AND_A_DAY_S
    for name in killed:
        os.utime(Path(mapping.uri) / "data" / name, (past, past))
    stage_fragments(mapping, rows(["web:running"]))  # a build that may still commit them
    running = data_files(mapping) - committed - killed
    assert killed and running
    publish.maintain_mapping(mapping, INDEXED)
    assert data_files(mapping) & (killed | running) == running
    assert committed <= data_files(mapping)
    assert sorted(mapping.latest().to_table(columns=["id"])["id"].to_pylist()) == [
        "web:a", "web:b"]


def test_an_incremental_run_that_compacts_the_mapping_reports_that_version(data_root,
                                                                          monkeypatch):
    monkeypatch.setattr(publish, "MAPPING_SMALL_FRAGMENTS", 1)
    build_corpus(data_root, "web", per_shape=3)
    mds.write_mds_tree(inputs_for(data_root, "web"), data_root, "web", OPTIONS)
    add_sample(data_root, NEW_ID)
    report = mds.write_mds_tree(inputs_for(data_root, "web"), data_root, "web", OPTIONS)
    table = Storage(data_root).table("mds_samples", "web")
    assert report.appended and report.mapping_version == table.latest_version()
    assert len(table.latest().open().get_fragments()) == 1  # the run's fragment merged in
    checks, problems = verify.verify_tree(data_root, "web")
    assert all(c.ok for c in checks) and not problems
