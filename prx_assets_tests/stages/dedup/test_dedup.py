import lance
import numpy as np
import pyarrow as pa

from prx_assets.stages.dedup.dedup import (
    DUPLICATES_SCHEMA,
    HashInput,
    bucket_of,
    duplicates_dataset,
    group_candidates,
    near_duplicate_shares,
    reference_duplicates,
    summarise,
)
from prx_assets.stages.images.stage import PHASH_SCHEMA
from prx_assets.storage.refs import TableRef


def _phash_table(uri, rows):
    lance.write_dataset(pa.Table.from_pylist(rows, schema=PHASH_SCHEMA), str(uri))
    return HashInput(source=uri.stem, rank=0, table=TableRef.of(uri, version=1))


def _candidates(rows, rank):
    return [{"id": r["id"], "phash": r["phash"], "pixels": r["pixels"], "rank": rank}
            for r in rows if not r["flat"]]


def test_group_keeps_most_pixels_then_source_order_then_id():
    rows = [
        {"id": "b:1", "phash": 7, "pixels": 100, "rank": 1},
        {"id": "a:9", "phash": 7, "pixels": 400, "rank": 0},  # largest wins
        {"id": "a:2", "phash": -3, "pixels": 50, "rank": 1},
        {"id": "c:1", "phash": -3, "pixels": 50, "rank": 0},  # tie: earlier source wins
        {"id": "a:1", "phash": 5, "pixels": 10, "rank": 0},
        {"id": "a:0", "phash": 5, "pixels": 10, "rank": 0},  # tie everywhere: smaller id
        {"id": "z:1", "phash": 11, "pixels": 10, "rank": 0},  # alone: not a duplicate
    ]
    got = group_candidates(pa.Table.from_pylist(rows)).sort_by("id").to_pylist()
    assert got == reference_duplicates(rows)
    kept = {r["id"]: r["kept_id"] for r in got}
    assert kept == {"a:0": "a:0", "a:1": "a:0", "a:2": "c:1", "c:1": "c:1",
                    "a:9": "a:9", "b:1": "a:9"}


def test_partitioned_ray_job_equals_single_process(ray_session, tmp_path):
    rng = np.random.default_rng(3)
    pool = rng.integers(-2**63, 2**63 - 1, size=300, dtype=np.int64)
    tables, candidates = [], []
    for rank, source in enumerate(["web", "art", "stock"]):
        rows = [{"id": f"{source}:{i:05d}", "phash": int(rng.choice(pool)),
                 "pixels": int(rng.integers(1, 5)) * 1000, "flat": bool(rng.random() < 0.05)}
                for i in range(800)]
        item = _phash_table(tmp_path / f"{source}.lance", rows)
        tables.append(HashInput(source, rank, item.table))
        candidates += _candidates(rows, rank)
    # 2,400 rows in buckets of 900: the shuffle really splits the hashes.
    result = duplicates_dataset(tables, rows_per_bucket=900).to_arrow_refs()
    import ray
    got = pa.concat_tables([ray.get(r) for r in result]).sort_by("id").to_pylist()
    assert got == reference_duplicates(candidates)
    assert len(got) > 1000
    flat_ids = {r["id"] for r in candidates}
    assert all(r["id"] in flat_ids for r in got)  # flat images never appear


def test_the_job_reads_blocks_of_many_fragments_and_counts_from_the_manifest(
        ray_session, tmp_path, monkeypatch):
    """The driver holds Ray Data's state per block, and a filtered count is a scan in the
    driver: 600 rows in 6 fragments are read as 3 blocks of <= 250 rows, counted unfiltered."""
    import ray.data

    rows = [{"id": f"web:{i:04d}", "phash": i % 50, "pixels": 1, "flat": False}
            for i in range(600)]
    uri = tmp_path / "web.lance"
    lance.write_dataset(pa.Table.from_pylist(rows, schema=PHASH_SCHEMA), str(uri),
                        max_rows_per_file=100)
    assert len(lance.dataset(str(uri)).get_fragments()) == 6
    filters, blocks = [], []
    count_rows, read_lance = lance.LanceDataset.count_rows, ray.data.read_lance
    monkeypatch.setattr(lance.LanceDataset, "count_rows", lambda self, filter=None, **kw: (
        filters.append(filter), count_rows(self, filter, **kw))[1])
    monkeypatch.setattr(ray.data, "read_lance", lambda *a, **kw: (
        blocks.append(kw.get("override_num_blocks")), read_lance(*a, **kw))[1])
    duplicates_dataset([HashInput("web", 0, TableRef.of(uri, version=1))], rows_per_read=250)
    assert blocks == [3]
    assert filters and not any(filters)


def test_buckets_spread_structured_hashes():
    hashes = np.arange(0, 64_000, 64, dtype=np.int64)  # low bits all zero
    counts = np.bincount(bucket_of(hashes, 8), minlength=8)
    assert counts.min() > 0.8 * counts.mean()


def test_near_duplicate_shares_ignore_exact_copies():
    base = np.array([0b1111, 0b0000_1111_0000], dtype=np.int64)
    corpus = [np.array([0b1111, 0b1110, 0b0000_1111_0000], dtype=np.int64)]
    shares = near_duplicate_shares(iter(corpus), base, max_distance=2)
    assert shares == {1: 0.5, 2: 0.5}


def test_summary_counts_removed_copies_per_source_and_the_largest_groups_across_batches(
        tmp_path):
    rows = [{"id": "web:1", "phash": 1, "pixels": 9, "rank": 0},
            {"id": "art:1", "phash": 1, "pixels": 1, "rank": 1},
            {"id": "art:2", "phash": 1, "pixels": 1, "rank": 1},
            {"id": "art:3", "phash": -2, "pixels": 5, "rank": 1},
            {"id": "web:2", "phash": -2, "pixels": 1, "rank": 0},
            {"id": "web:3", "phash": 3, "pixels": 1, "rank": 0},
            {"id": "web:4", "phash": 3, "pixels": 1, "rank": 0}]
    uri = tmp_path / "duplicates.lance"
    lance.write_dataset(group_candidates(pa.Table.from_pylist(rows)).cast(DUPLICATES_SCHEMA),
                        str(uri))
    summary = summarise(TableRef.of(uri), {"web": 4, "art": 3}, top=2, batch_rows=2)
    assert summary.groups == 3
    assert summary.removed_per_source == {"art": 2, "web": 2}
    assert summary.largest == [
        {"phash": "0000000000000001", "group_size": 3, "kept_id": "web:1"},
        {"phash": "fffffffffffffffe", "group_size": 2, "kept_id": "art:3"}]
