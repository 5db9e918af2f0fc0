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


def write_both(folder: Path, rows: list[dict], size_limit: int | None) -> tuple[list, list]:
    with MDSWriter(out=str(folder / "theirs"), columns=MDS_COLUMNS, size_limit=size_limit,
                   compression=None) as theirs:
        for row in rows:
            theirs.write(row)
    with shard_writer(Location.of(folder / "ours"), MDS_COLUMNS, size_limit) as ours:
        for row in rows:
            ours.write(row)
    return theirs.shards, ours.shards


def test_shards_and_entries_are_mdswriters_byte_for_byte(tmp_path: Path):
    rows = samples(12)
    sizer = ShardWriter(Location.of(tmp_path), MDS_COLUMNS, None)
    # The size of a shard of the first five samples as MDSWriter counts it: at that limit
    # they fit, a byte under it the fifth starts the next shard.
    five = 8 + len(sizer.config_data) + sum(len(sizer.encode(row)) + 4 for row in rows[:5])
    # No limit; a limit under a single sample (MDSWriter then writes an empty shard first).
    for size_limit in [None, five, five - 1, 300]:
        folder = tmp_path / str(size_limit)
        theirs, ours = write_both(folder, rows, size_limit)
        assert shard_files(folder / "ours") == shard_files(folder / "theirs"), size_limit
        assert ours == theirs
        if size_limit == five:
            assert theirs[0]["samples"] == 5
    assert len(theirs) > 1


def test_a_value_of_the_wrong_type_is_refused(tmp_path: Path):
    writer = ShardWriter(Location.of(tmp_path), {"n": "int", "t": "str"}, None)
    with pytest.raises(TypeError):
        writer.write({"n": "1", "t": "x"})
    with pytest.raises(ValueError, match="torch-free"):
        ShardWriter(Location.of(tmp_path), {"a": "pkl"}, None)
