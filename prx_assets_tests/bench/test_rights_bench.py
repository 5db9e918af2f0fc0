"""The rights bench's ingest-level pass: it measures an ingest's real work on a shard (the
rows it commits carry what the readers found, or nothing with them off), and its helpers
cut and write what an ingest would see."""

from __future__ import annotations

import lance
import pyarrow as pa
import pytest

from bench.rights import chunked, ingest_once, write_shard
from prx_assets.stages.ingest import readers
from prx_assets.stages.ingest.raw_rows import FoundItem
from prx_assets.stages.ingest.sources import SourceSpec
from prx_assets.testing import rights_fixtures as rf


def test_chunks_are_cut_again_to_the_commit_size_in_order():
    tables = [pa.table({"n": list(range(start, start + size))})
              for start, size in ((0, 3), (3, 5), (8, 2))]
    chunks = list(chunked(tables, 4))
    assert [c.num_rows for c in chunks] == [4, 4, 2]
    assert [n for c in chunks for n in c.column("n").to_pylist()] == list(range(10))


def test_a_shard_holds_each_item_and_its_sidecar_as_a_crawler_writes_them(tmp_path):
    items = [FoundItem(key="a.jpeg", data=rf.photo("jpeg", 32), meta={"url": "https://x.org/a"}),
             FoundItem(key="b.png", data=rf.photo("png", 32))]
    shard = write_shard(tmp_path / "000.tar", items)
    spec = SourceSpec(name="s", kind="webdataset", uri=str(tmp_path))
    found = list(readers.read_tar(spec, tmp_path, shard.name))
    assert [f.data for f in found] == [i.data for i in items]
    assert [f.url for f in found] == ["https://x.org/a", "https://photos.example.org/1.jpg"]


@pytest.mark.skipif(not rf.exiftool_available(), reason="exiftool not installed")
def test_an_ingest_pass_commits_every_row_with_its_reservation_or_none_without_readers(
        tmp_path):
    pytest.importorskip("c2pa")
    samples = rf.signal_samples(tmp_path / "fixtures", size=96)
    (tmp_path / "shard").mkdir()
    shard = rf.write_signal_tar(tmp_path / "shard" / "000.tar", samples)
    tables = {}
    for read_rights in (True, False):
        table = tmp_path / f"{read_rights}.lance"
        seconds, user, run = ingest_once(shard, table, read_rights)
        assert seconds > 0 and user >= 0 and run.committed == len(samples)
        tables[read_rights] = lance.dataset(str(table)).to_table().sort_by("source_key")
    assert tables[True].column("reservation").to_pylist() == [s.status for s in samples]
    assert set(tables[False].column("reservation").to_pylist()) == {"none"}
    assert tables[True].column("id") == tables[False].column("id")
    assert tables[True].column("image") == tables[False].column("image")
