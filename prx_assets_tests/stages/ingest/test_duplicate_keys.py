"""A key in two units of one chunk, without Ray: the unit first by name keeps it."""

import pyarrow as pa

from prx_assets.stages.ingest.duplicate_keys import rows_to_commit
from prx_assets.stages.ingest.ids import sample_id

SCHEMA = pa.schema([(name, pa.string()) for name in
                    ("id", "source", "source_key", "unit", "format", "status", "error")]
                   + [("image", pa.binary()), ("width", pa.int32()), ("height", pa.int32())])


def row(unit: str, key: str = "x") -> dict:
    return {"id": sample_id("pq", key), "source": "pq", "source_key": key, "unit": unit,
            "format": "jpeg", "status": "ok", "error": None, "image": b"jpeg", "width": 4,
            "height": 3}


def test_the_unit_first_by_name_keeps_the_key_whatever_the_read_order():
    chunk = pa.Table.from_pylist([row("b.parquet"), row("a.parquet"), row("a.parquet", "y")],
                                 schema=SCHEMA)
    got = {r["source_key"]: r for r in rows_to_commit(chunk).to_pylist()}
    assert sorted(got) == ["b.parquet#x", "x", "y"]
    assert got["x"]["unit"] == "a.parquet" and got["x"]["image"] == b"jpeg"
    duplicate = got["b.parquet#x"]
    assert duplicate["status"] == "duplicate_key" and duplicate["image"] is None
    assert duplicate["id"] == sample_id("pq", "b.parquet#x") != got["x"]["id"]
    assert "'a.parquet'" in duplicate["error"] and "'b.parquet'" in duplicate["error"]


def test_a_chunk_of_distinct_keys_is_left_as_it_is():
    chunk = pa.Table.from_pylist([row("a.parquet"), row("b.parquet", "y")], schema=SCHEMA)
    assert rows_to_commit(chunk).equals(chunk)
