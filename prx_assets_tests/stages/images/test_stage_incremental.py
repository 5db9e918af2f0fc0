"""What the image stage has to do, decided per row: pending raw rows (new, changed bytes,
other settings) and removed ids, on the driver's broadcast path and on the Ray join path."""

import lance
import pyarrow as pa
import pytest
import ray.data

from prx_assets.engine.removals import removed_ids
from prx_assets.stages.images.imaging import ImageOptions
from prx_assets.stages.images.stage import (
    BUCKETED_SCHEMA,
    ImageTables,
    pending_raw,
    settings_fingerprint,
)
from prx_assets.storage.refs import TableRef

CURRENT = settings_fingerprint(ImageOptions())


def test_fingerprint_follows_every_setting():
    from prx_assets.stages.images.buckets import BucketRule

    variants = [ImageOptions(quality=90), ImageOptions(subsampling="4:2:0"),
                ImageOptions(resize_mode="stretch"), ImageOptions(draft_margin=None),
                ImageOptions(reducing_gap=None), ImageOptions(max_pixels=1000),
                ImageOptions(rule=BucketRule(tiers=(512,)))]
    prints = {settings_fingerprint(v) for v in variants}
    assert len(prints) == len(variants) and CURRENT not in prints
    assert settings_fingerprint(ImageOptions()) == CURRENT  # stable


@pytest.mark.parametrize("broadcast_limit", [1_000_000, 0])  # 0: the Ray hash-join path
def test_pending_and_removed_rows(ray_session, tmp_path, broadcast_limit):
    raw_rows = [{"id": "same", "sha256": "a"}, {"id": "changed", "sha256": "new"},
                {"id": "other_settings", "sha256": "c"}, {"id": "new", "sha256": "d"},
                {"id": "no_bytes", "sha256": None}]
    raw_uri = str(tmp_path / "raw.lance")
    raw = TableRef.of(raw_uri).at(lance.write_dataset(pa.Table.from_pylist(raw_rows),
                                                      raw_uri).version)
    made = [("same", "a", CURRENT), ("changed", "old", CURRENT), ("other_settings", "c", "x"),
            ("no_bytes", None, CURRENT), ("gone", "e", CURRENT)]
    bucketed = [{"id": i, "source": "s", "status": "ok", "raw_sha256": sha, "settings": fp}
                for i, sha, fp in made]
    tables = ImageTables(TableRef.of(tmp_path / "bucketed.lance"),
                         TableRef.of(tmp_path / "phashes.lance"))
    lance.write_dataset(pa.Table.from_pylist(bucketed, schema=BUCKETED_SCHEMA),
                        tables.bucketed.uri)

    pending = pending_raw(ray.data.read_lance(raw_uri), tables, CURRENT, broadcast_limit)
    assert sorted(pending.to_pandas()["id"]) == ["changed", "new", "other_settings"]
    assert set(pending.columns()) == {"id", "sha256"}  # the join key does not leak
    gone = removed_ids(tables.bucketed, raw, broadcast_limit)
    assert gone.to_pylist() == ["gone"]


def test_nothing_is_fresh_without_a_table(ray_session, tmp_path):
    raw_uri = str(tmp_path / "raw.lance")
    lance.write_dataset(pa.table({"id": ["a"], "sha256": ["x"]}), raw_uri)
    tables = ImageTables(TableRef.of(tmp_path / "bucketed.lance"),
                         TableRef.of(tmp_path / "phashes.lance"))
    assert pending_raw(ray.data.read_lance(raw_uri), tables, CURRENT).count() == 1
    assert len(removed_ids(tables.bucketed, TableRef.of(raw_uri))) == 0


def test_tables_from_before_the_made_from_columns_start_over(tmp_path):
    from prx_assets.stages.images.stage import PHASH_SCHEMA, ensure_table

    tables = ImageTables(TableRef.of(tmp_path / "bucketed.lance"),
                         TableRef.of(tmp_path / "phashes.lance"))
    old_schema = pa.schema([f for f in BUCKETED_SCHEMA if f.name not in ("raw_sha256",
                                                                         "settings")])
    lance.write_dataset(pa.Table.from_pylist([{"id": "a", "source": "s", "status": "ok"}],
                                             schema=old_schema), tables.bucketed.uri)
    lance.write_dataset(pa.Table.from_pylist([{"id": "a", "phash": 1}], schema=PHASH_SCHEMA),
                        tables.phashes.uri)
    assert ensure_table(tables.bucketed, BUCKETED_SCHEMA)
    assert not ensure_table(tables.bucketed, BUCKETED_SCHEMA)  # current now
    assert tables.bucketed.open().schema == BUCKETED_SCHEMA
    assert tables.bucketed.count_rows() == 0
    assert ensure_table(tables.phashes, PHASH_SCHEMA, replace=True)
    assert tables.phashes.count_rows() == 0
