"""The torch-free shard writer writes what streaming's MDSWriter writes, byte for byte."""

from pathlib import Path

import pytest
from streaming import MDSWriter

from prx_assets.stages.shards.plan import MDS_COLUMNS
from prx_assets.stages.shards.shard_writer import ShardWriter, shard_writer
from prx_assets.storage.refs import Location


def samples(n: int) -> list[dict]:
    return [{"image": bytes([i % 251]) * (40 + 37 * i), "caption": f"une légende {i}",
             "id": f"s:{i:03d}", "source": "s", "width": 64 + i, "height": 48,
             "original_width": 640 * i, "original_height": -1, "license": "cc-by",
             "url": "", "license_url": "", "attribution": "ünïcode"} for i in range(n)]


def shard_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("shard.*"))}


@pytest.mark.parametrize("size_limit", [None, 1 << 10, 300])
def test_shards_and_entries_are_mdswriters_byte_for_byte(tmp_path: Path, size_limit):
    rows = samples(12)  # at 300 bytes, the larger samples are each over the limit
    with MDSWriter(out=str(tmp_path / "theirs"), columns=MDS_COLUMNS, size_limit=size_limit,
                   compression=None) as theirs:
        for row in rows:
            theirs.write(row)
    with shard_writer(Location.of(tmp_path / "ours"), MDS_COLUMNS, size_limit) as ours:
        for row in rows:
            ours.write(row)
    expected = shard_files(tmp_path / "theirs")
    assert len(expected) > (1 if size_limit else 0)
    assert shard_files(tmp_path / "ours") == expected
    assert ours.shards == theirs.shards


def test_a_value_of_the_wrong_type_is_refused(tmp_path: Path):
    writer = ShardWriter(Location.of(tmp_path), {"n": "int", "t": "str"}, None)
    with pytest.raises(TypeError):
        writer.write({"n": "1", "t": "x"})
    with pytest.raises(ValueError, match="torch-free"):
        ShardWriter(Location.of(tmp_path), {"a": "pkl"}, None)
