"""The captions' record of bucketed_images: a run with a record is handed the kept images
written since (and retries failures, and takes the items whose caption was dropped as
stale) instead of comparing every kept id; past its limit, or after a compaction of
bucketed, it compares in full. Real Lance tables, no Ray."""

import lance
import pyarrow as pa

from prx_assets.stages.captions.captioners import CaptionerSpec
from prx_assets.stages.captions.captions import CAPTIONS_SCHEMA
from prx_assets.stages.captions.runs import UPSTREAM, bucketed_changes, pending_changed_ids
from prx_assets.storage.changes import consumed_at, record_consumed
from prx_assets.storage.refs import TableRef

SPEC = CaptionerSpec(backend="transformers", model="tiny-vlm")


def record_bucketed_consumed(bucketed: TableRef, captions: TableRef, spec: CaptionerSpec
                             ) -> None:
    """What a finished captions run records (`engine.stage.run_stage`)."""
    record_consumed(captions, UPSTREAM, consumed_at(bucketed.open(), spec.version()))
BUCKETED = pa.schema([("id", pa.string()), ("status", pa.string())])


def write_bucketed(uri: str, rows: dict[str, str], mode: str = "create") -> TableRef:
    table = pa.Table.from_pylist([{"id": i, "status": s} for i, s in rows.items()], BUCKETED)
    lance.write_dataset(table, uri, mode=mode)
    return TableRef.of(uri).pinned()


def write_captions(uri: str, rows: dict[str, str], mode: str = "create") -> TableRef:
    table = pa.Table.from_pylist(
        [{"id": i, "caption_version": SPEC.version(), "status": s, "caption": "c"}
         for i, s in rows.items()], schema=CAPTIONS_SCHEMA)
    lance.write_dataset(table, uri, mode=mode)
    return TableRef.of(uri)


def recorded(tmp_path) -> tuple[TableRef, TableRef]:
    """b0..b3 kept (b3 failed its caption), r0 rejected; the record taken."""
    bucketed = write_bucketed(str(tmp_path / "b.lance"),
                              {"b0": "ok", "b1": "ok", "b2": "ok", "b3": "ok", "r0": "too_small"})
    captions = write_captions(str(tmp_path / "c.lance"),
                              {"b0": "ok", "b1": "ok", "b2": "empty", "b3": "failed"})
    record_bucketed_consumed(bucketed, captions, SPEC)
    return bucketed, captions


def pending(bucketed, captions, **kwargs) -> list[str] | None:
    changes = bucketed_changes(bucketed, captions, SPEC)
    assert changes is not None
    ids = pending_changed_ids(bucketed, changes, captions, SPEC, **kwargs)
    return None if ids is None else sorted(ids.to_pylist())


def test_without_a_record_the_run_compares_in_full(tmp_path):
    bucketed = write_bucketed(str(tmp_path / "b.lance"), {"b0": "ok"})
    captions = write_captions(str(tmp_path / "c.lance"), {"b0": "ok"})
    assert bucketed_changes(bucketed, captions, SPEC) is None
    record_bucketed_consumed(bucketed, captions, SPEC)
    other = CaptionerSpec(backend="transformers", model="another-vlm")
    assert bucketed_changes(bucketed, captions, other) is None  # another caption version


def test_new_kept_images_and_failures_are_pending(tmp_path):
    bucketed, captions = recorded(tmp_path)
    assert pending(bucketed, captions) == ["b3"]  # nothing new: the failure is retried
    bucketed = write_bucketed(bucketed.uri, {"b4": "ok", "r1": "too_small", "b1": "ok"},
                              mode="append")
    # b1 came again (a replaced image's row) but its caption is done: the stale one is
    # dropped by the run before it asks; r1 is rejected.
    assert pending(bucketed, captions) == ["b3", "b4"]
    write_captions(captions.uri, {"b4": "ok", "b3": "ok"}, mode="append")
    assert pending(bucketed, captions) == []


def test_items_whose_caption_was_dropped_are_taken_when_kept(tmp_path):
    bucketed, captions = recorded(tmp_path)
    lance.dataset(captions.uri).delete("id = 'b0'")  # its source caption changed
    also = pa.array(["b0", "r0", "gone"], pa.string())
    assert pending(bucketed, captions, also=also) == ["b0", "b3"]


def test_past_the_limit_or_after_a_compaction_the_run_compares_in_full(tmp_path):
    bucketed, captions = recorded(tmp_path)
    bucketed = write_bucketed(bucketed.uri, {f"n{i}": "ok" for i in range(5)}, mode="append")
    assert pending(bucketed, captions, limit=4) is None
    assert pending(bucketed, captions, limit=6) == ["b3", *(f"n{i}" for i in range(5))]
    lance.dataset(bucketed.uri).optimize.compact_files()
    compacted = TableRef.of(bucketed.uri).pinned()
    changes = bucketed_changes(compacted, captions, SPEC)
    assert changes is not None and changes.added_rows == 10  # every row comes as written
    assert pending(compacted, captions, limit=9) is None


def test_a_replaced_file_waits_for_its_new_image(tmp_path):
    """Raw holds new bytes for r1 (replaced) and r2 is gone; bucketed still holds the rows
    made from the old bytes: r1 and r2 wait (a model would describe the old image)."""
    from prx_assets.stages.captions.runs import awaiting_new_images

    def table(name: str, rows: list[dict]) -> TableRef:
        lance.write_dataset(pa.Table.from_pylist(rows), str(tmp_path / name))
        return TableRef.of(tmp_path / name).pinned()

    bucketed = table("b.lance", [{"id": f"r{i}", "raw_sha256": f"old{i}"} for i in range(3)])
    raw = table("r.lance", [{"id": "r0", "sha256": "old0"}, {"id": "r1", "sha256": "new1"}])
    ids = pa.array(["r0", "r1", "r2", "never"], pa.string())
    assert sorted(awaiting_new_images(bucketed, raw, ids).to_pylist()) == ["r1", "r2"]
    assert len(awaiting_new_images(bucketed, raw, ids[:0])) == 0
