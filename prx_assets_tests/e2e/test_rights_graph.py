"""Issue 46's acceptance: a WebDataset shard whose members carry training reservations (XMP,
C2PA, a corrupt manifest, X-Robots-Tag, TDMRep, a reserved domain) goes through source_job,
and the loader never yields a reserved sample: from the sidecars, and with every sidecar
deleted (the guard, failing closed)."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest

from prx_assets.definitions import build_defs
from prx_assets.loader import build_dataset
from prx_assets.stages.opt_outs.rights import domains_dir
from prx_assets.stages.shards.card import read_card
from prx_assets.storage.layout import Storage
from prx_assets.storage.sidecars import REASON_RIGHTS, read_sidecar, sidecar_files
from prx_assets.storage.tables import RAW_IMAGES
from prx_assets.storage.trees import tree_store
from prx_assets.testing import rights_fixtures as rf
from prx_assets.testing.sources import write_sources

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("fresh_shared_memory"),
              pytest.mark.skipif(not rf.exiftool_available(), reason="exiftool not installed")]


def _streamed(root: Path, guard: bool) -> dict[str, dict]:
    """Each streamed sample's provenance columns, by id."""
    dataset = build_dataset(root / "mds", 512, 1, weights={"web": 1.0}, shuffle=False,
                            decode_images=False, guard_opt_outs=guard)
    try:
        return {sample["id"]: {c: sample[c] for c in ("url", "license", "attribution")}
                for sample in dataset}
    finally:
        dataset.reader_leases.release()


@pytest.mark.timeout(600)
def test_reserved_samples_never_reach_the_loader(ray_session, data_root, tmp_path):
    pytest.importorskip("c2pa")
    samples = rf.signal_samples(tmp_path / "fixtures")
    shards = tmp_path / "shards"
    shards.mkdir()
    rf.write_signal_tar(shards / "000.tar", samples)
    sources = write_sources(tmp_path / "sources.yaml", [
        f"{{name: web, kind: webdataset, uri: {shards}, license: cc0, "
        "caption_extension: json, caption_field: caption}"])
    (domains_dir(Storage(data_root)) / "registry.txt").write_text(f"{rf.RESERVED_DOMAIN}\n")

    with dg.instance_for_test() as instance:
        result = build_defs(sources, tmp_path / "captioner.yaml").resolve_job_def(
            "source_job").execute_in_process(partition_key="web", instance=instance,
                                             raise_on_error=False)
    assert result.success, [e.message for e in result.all_events if e.is_failure]
    ingested = next(e.event_specific_data.materialization.metadata for e in
                    result.get_asset_materialization_events()
                    if e.event_specific_data.materialization.asset_key.path[-1] == RAW_IMAGES)
    assert ingested["reservations"].value == {"none": 4, "prohibited": 5, "constrained": 1}

    raw = {r["source_key"]: r for r in Storage(data_root).table(RAW_IMAGES, "web").to_table(
        columns=["id", "source_key", "license", "attribution", "reservation",
                 "reservation_signal", "status"]).to_pylist()}
    key = {s.key: f"000.tar/{s.key}" for s in samples}
    assert {s.key: raw[key[s.key]]["reservation"] for s in samples} == {
        s.key: s.status for s in samples}
    assert "unreadable manifest" in raw[key["s5"]]["reservation_signal"]
    assert raw[key["s0"]]["license"] == "cc-by-4.0"
    assert raw[key["s0"]]["attribution"] == "Photographer 0"
    ids = {s.key: raw[key[s.key]]["id"] for s in samples}
    kept = {ids[k] for k in ("s0", "s3", "s9")}

    tree = tree_store(Storage(data_root), "web").current_tree()
    skipped = {i for sidecar in sidecar_files(Path(tree.uri))
               for i in read_sidecar(sidecar).get(REASON_RIGHTS, [])}
    assert len(skipped) == 7
    streamed = _streamed(data_root, guard=False)
    assert set(streamed) == kept  # the sidecars alone
    assert streamed[ids["s0"]] == {"url": "https://photos.example.org/0.jpg",
                                   "license": "cc-by-4.0", "attribution": "Photographer 0"}
    card = read_card(tree)
    assert {k: v["count"] for k, v in card["reservations"].items()} == {
        "none": 4, "prohibited": 5, "constrained": 1}
    assert card["licenses"]["cc-by-4.0"]["count"] == 10

    for sidecar in sidecar_files(Path(tree.uri)):
        sidecar.unlink()
    assert set(_streamed(data_root, guard=False)) == set(ids.values())  # nothing skips them
    assert set(_streamed(data_root, guard=True)) == kept  # ...but the guard does
