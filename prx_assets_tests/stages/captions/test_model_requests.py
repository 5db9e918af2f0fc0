"""A model backend's run with few pending images: the pending ids are selected from an id-only
read, and only their images are read (a +1 run used to read every kept image's bytes to keep
the one pending)."""

import lance
import pyarrow as pa

from prx_assets.stages.captions.captioners import CaptionerSpec
from prx_assets.stages.captions.captions import CAPTIONS_SCHEMA
from prx_assets.stages.captions.runs import pending_ids, requests_for
from prx_assets.storage.refs import TableRef

SPEC = CaptionerSpec(backend="transformers", model="tiny-vlm")


def bucketed_table(tmp_path) -> TableRef:
    rows = [{"id": f"i{n}", "status": "ok", "image": f"bytes of {n}".encode()}
            for n in range(5)] + [{"id": "tiny", "status": "too_small", "image": None}]
    uri = str(tmp_path / "bucketed.lance")
    lance.write_dataset(pa.Table.from_pylist(rows, schema=pa.schema([
        ("id", pa.string()), ("status", pa.string()), ("image", pa.large_binary())])), uri)
    return TableRef.of(uri).pinned()


def captions_table(tmp_path, done: dict[str, str]) -> TableRef:
    rows = [{"id": i, "caption_version": SPEC.version(), "status": status, "caption": "c"}
            for i, status in done.items()]
    uri = str(tmp_path / "captions.lance")
    lance.write_dataset(pa.Table.from_pylist(rows, schema=CAPTIONS_SCHEMA), uri)
    return TableRef.of(uri)


def test_few_pending_images_are_read_by_id(ray_session, tmp_path):
    bucketed = bucketed_table(tmp_path)
    captions = captions_table(tmp_path, {"i0": "ok", "i1": "ok", "i2": "empty", "i3": "failed"})
    ids = pending_ids(bucketed, captions, SPEC)
    assert sorted(ids.to_pylist()) == ["i3", "i4"]  # a failure is retried; rejects never
    rows = requests_for(bucketed, ids).take_all()
    assert sorted((r["id"], r["image"]) for r in rows) == [("i3", b"bytes of 3"),
                                                           ("i4", b"bytes of 4")]


def test_many_pending_images_are_left_to_the_whole_read(ray_session, tmp_path):
    bucketed = bucketed_table(tmp_path)
    captions = captions_table(tmp_path, {"i0": "ok"})
    assert pending_ids(bucketed, captions, SPEC, limit=3) is None
    assert len(pending_ids(bucketed, captions, SPEC, limit=4)) == 4


def test_nothing_pending_reads_no_image(ray_session, tmp_path):
    bucketed = bucketed_table(tmp_path)
    captions = captions_table(tmp_path, {f"i{n}": "ok" for n in range(5)})
    ids = pending_ids(bucketed, captions, SPEC)
    assert len(ids) == 0 and requests_for(bucketed, ids) is None
