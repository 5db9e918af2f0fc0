"""Duplicates, opt-outs and skip lists through Dagster on two small real sources."""

import hashlib
import io
import json

import dagster as dg
import pyarrow as pa
from PIL import Image

from prx_assets.definitions import build_defs
from prx_assets.defs.report import WARNINGS_TAG, tag_run_with_warnings
from prx_assets.demo.corpus import encode, real_photo_paths
from prx_assets.stages.images.phash import phash
from prx_assets.stages.images.stage import PHASH_SCHEMA
from prx_assets.stages.ingest.ids import sample_id
from prx_assets.stages.ingest.raw_rows import RAW_IMAGES_SCHEMA
from prx_assets.storage.lance_tables import overwrite_rows
from prx_assets.storage.layout import Storage
from prx_assets.storage.sidecars import read_sidecar
from prx_assets.testing.images import image_bytes
from prx_assets.testing.sources import write_sources


def _photo(index: int, scale: float) -> bytes:
    """A real photo (deterministic, unlike generated images whose grain is unseeded) at a
    scale; the photos chosen hash far from their median, so every scale shares the hash."""
    base = Image.open(real_photo_paths()[index]).convert("RGB")
    size = (int(base.width * scale), int(base.height * scale))
    return encode(base.resize(size, Image.LANCZOS), "JPEG", 90)


ASTRONAUT, CHELSEA, COFFEE, CAMERA, HOPPER = 0, 1, 2, 11, 15
CORPUS = {
    "web": {"p1.jpg": (ASTRONAUT, 1.0), "p1copy.jpg": (ASTRONAUT, 1.0),
            "p2.jpg": (COFFEE, 0.5), "p3.jpg": (CHELSEA, 1.0), "flat.png": None,
            "u1.jpg": (CAMERA, 1.0)},
    "stock": {"p1.jpg": (ASTRONAUT, 0.5), "p2.jpg": (COFFEE, 1.5), "p3.jpg": (CHELSEA, 1.0),
              "flat.png": None, "u2.jpg": (HOPPER, 1.0)},
}


def _write_source(root, source, items):
    """raw_images (key columns) and phashes rows as the image stage writes them, with the
    pipeline's own phash of each real image; plus an MDS mapping table and shard files
    laid out as the shard writer does (two shards per leaf)."""
    raw, hashes, mapping = [], [], []
    for key, spec in sorted(items.items()):
        data = (image_bytes(Image.new("RGB", (600, 600), (90, 90, 90)), "PNG") if spec is None
                else _photo(*spec))
        img = Image.open(io.BytesIO(data))
        value, flat = phash(img.convert("RGB"))
        sample = sample_id(source, key)
        raw.append({"id": sample, "source": source, "source_key": key, "status": "ok",
                    "sha256": hashlib.sha256(data).hexdigest(), "width": img.width,
                    "height": img.height, "n_bytes": len(data), "format": img.format})
        hashes.append({"id": sample, "phash": value, "pixels": img.width * img.height,
                       "flat": flat})
    for n, row in enumerate(sorted(raw, key=lambda r: r["id"])):
        mapping.append({"id": row["id"], "source": source, "tier": 512, "width": 512,
                        "height": 512, "leaf": "512/512x512", "shard": f"shard.{n % 2:05d}.mds",
                        "sample_index": n // 2, "tree_version": "t1"})
        shard = root / "mds" / source / "512/512x512" / mapping[-1]["shard"]
        shard.parent.mkdir(parents=True, exist_ok=True)
        shard.write_bytes(b"MDS shard")
    for name, rows, schema in [("raw_images", raw, RAW_IMAGES_SCHEMA),
                               ("phashes", hashes, PHASH_SCHEMA), ("mds_samples", mapping, None)]:
        table = pa.Table.from_pylist(rows, schema=schema)
        overwrite_rows(Storage(root).table(name, source), table, table.schema)
    return {r["source_key"]: r for r in raw}, {r["id"]: r for r in mapping}


def _sidecars(root, source):
    found = {}
    for path in sorted((root / "mds" / source).rglob("*.skip.json")):
        found[str(path.relative_to(root / "mds" / source))] = read_sidecar(path)
    return found


def test_duplicates_opt_outs_sensor_and_skip_lists(ray_session, data_root, tmp_path):
    sources = write_sources(tmp_path / "s.yaml", [
        f"{{name: {name}, kind: image_folder, uri: {tmp_path}}}" for name in CORPUS])
    defs = build_defs(sources)
    instance = dg.DagsterInstance.ephemeral()
    (web, web_mds), (stock, _) = (_write_source(data_root, s, CORPUS[s]) for s in CORPUS)
    hashes = {s: {r["id"]: r["phash"] for r in Storage(data_root).table(
        "phashes", s).to_table().to_pylist()} for s in CORPUS}
    assert hashes["web"][web["p1.jpg"]["id"]] == hashes["stock"][stock["p1.jpg"]["id"]]
    result = defs.resolve_job_def("dedup_job").execute_in_process(instance=instance)
    assert result.success

    # Cross-source, cross-resolution groups keep the most pixels; exact ties go to the
    # first source, then to the smaller id; flat images are never duplicates.
    dups = Storage(data_root).table("duplicates").to_table().to_pylist()
    groups = {}
    for row in dups:
        groups.setdefault(row["kept_id"], set()).add(row["id"])
    p1_kept = min(web["p1.jpg"]["id"], web["p1copy.jpg"]["id"])
    assert groups == {
        p1_kept: {web["p1.jpg"]["id"], web["p1copy.jpg"]["id"], stock["p1.jpg"]["id"]},
        stock["p2.jpg"]["id"]: {web["p2.jpg"]["id"], stock["p2.jpg"]["id"]},
        web["p3.jpg"]["id"]: {web["p3.jpg"]["id"], stock["p3.jpg"]["id"]}}
    assert all(r["group_size"] == len(groups[r["kept_id"]]) for r in dups)
    meta = _materialization(result, "duplicates")
    per_source = {r.data["source"]: r.data for r in meta["removed_per_source"].value.records}
    assert per_source["web"]["removed"] == 2 and per_source["stock"]["removed"] == 2
    assert per_source["web"]["hashed"] == 5  # six images, one flat
    assert meta["input_version/phashes/web"].value >= 1
    assert meta["largest_groups"].value.records[0].data["group_size"] == 3
    assert meta["run"].value == "full"
    # Nothing hashed since: the next run updates the groups from the (empty) changes.
    again = _materialization(defs.resolve_job_def("dedup_job").execute_in_process(
        instance=instance), "duplicates")
    assert (again["run"].value, again["hashes_rechecked"].value) == ("incremental", 0)
    assert Storage(data_root).table("duplicates").to_table().to_pylist() == dups

    # Opt-outs arrive: first a file touching only stock, then one touching web.
    requests = data_root / "opt_outs"
    requests.mkdir()
    (requests / "001.csv").write_text(
        "key_type,value,timestamp,reference\n"
        "source_key,u2.jpg,2026-11-01T00:00:00Z,ticket-1\n"
        "id,nonsense,2026-11-01T00:00:00Z,ticket-2\n")
    sensor = defs.get_sensor_def("opt_out_sensor")
    sensor_resources = {"storage": defs.resources["storage"]}
    first = sensor(dg.build_sensor_context(instance=instance, resources=sensor_resources))
    assert _requested(first) == [("opt_outs", None), ("skip_lists", "stock")]
    (requests / "002.jsonl").write_text(json.dumps({
        "key_type": "sha256", "value": stock["p2.jpg"]["sha256"], "timestamp": "2026-11-02",
        "reference": "ticket-3"}) + "\n" + json.dumps({
        "key_type": "id", "value": web["u1.jpg"]["id"], "timestamp": "2026-11-02",
        "reference": "ticket-4"}) + "\n")
    second = sensor(dg.build_sensor_context(instance=instance, cursor=first.cursor,
                                            resources=sensor_resources))
    # The first batch's runs were not created (no daemon here): they are asked for again
    # and the new file waits for them (test_opt_outs_fail_closed follows a batch through).
    assert _requested(second) == _requested(first)
    assert ({r.run_key for r in second.run_requests}
            == {r.run_key for r in first.run_requests})
    both = sensor(dg.build_sensor_context(instance=instance, resources=sensor_resources))
    # stock:p2 opted out by bytes; its duplicate web:p2 goes too, so both are affected.
    assert _requested(both) == [("opt_outs", None), ("skip_lists", "stock"),
                                ("skip_lists", "web")]

    audit_run = defs.resolve_job_def("dedup_job").execute_in_process(instance=instance)
    audit_meta = _materialization(audit_run, "opt_outs")
    assert audit_meta["malformed_rows"].value == 1
    assert audit_meta["malformed"].value.records[0].data["line"] == 3
    assert audit_meta["ids_removed"].value == 4  # stock u2, stock p2, web p2, web u1

    (data_root / "ablations").mkdir()
    (data_root / "ablations" / "no_u1.txt").write_text(web["u1.jpg"]["id"] + "\n")
    shard_bytes = {p: p.read_bytes() for p in (data_root / "mds").rglob("*.mds")}
    run = defs.resolve_job_def("skip_lists_job").execute_in_process(
        partition_key="web", instance=instance)
    assert run.success
    mapping = web_mds
    expected: dict = {}
    for reason, key in [("dedup", "p2.jpg"), ("optout", "p2.jpg"), ("optout", "u1.jpg"),
                        ("no_u1", "u1.jpg"),
                        ("dedup", "p1copy.jpg" if p1_kept == web["p1.jpg"]["id"] else "p1.jpg")]:
        row = mapping[web[key]["id"]]
        sidecar = f"{row['leaf']}/{row['shard'].replace('.mds', '.skip.json')}"
        expected.setdefault(sidecar, {}).setdefault(reason, []).append(row["sample_index"])
    assert _sidecars(data_root, "web") == {k: {r: sorted(v) for r, v in lists.items()}
                                          for k, lists in expected.items()}
    assert {p: p.read_bytes() for p in (data_root / "mds").rglob("*.mds")} == shard_bytes
    assert _sidecars(data_root, "stock") == {}  # its run was not requested here
    meta = _materialization(run, "skip_lists")
    reasons = {r.data["reason"]: r.data["skipped"]
               for r in meta["skipped_per_reason"].value.records}
    assert reasons == {"dedup": 2, "optout": 2, "no_u1": 1}
    applied = {r.data["reason"]: r.data["applied"]
               for r in meta["skipped_per_reason"].value.records}
    assert applied["no_u1"] == "opt-in (when a run names it)"  # an ablation list
    assert applied["dedup"] == applied["optout"] == "by default"
    assert meta["skipped"].value == 3 and meta["samples"].value == 6
    # The first skip lists of this tree: the 3 skipped samples are its work, 3 carried as is.
    assert (meta["rows_processed"].value, meta["rows_reused"].value,
            meta["rows_removed"].value) == (3, 3, 0)
    again = defs.resolve_job_def("skip_lists_job").execute_in_process(
        partition_key="web", instance=instance)
    again_meta = _materialization(again, "skip_lists")
    assert (again_meta["rows_processed"].value, again_meta["rows_reused"].value) == (0, 6)
    check = {e.asset_check_key.name: e for e in run.get_asset_check_evaluations()}
    assert check["skipped_share"].passed is False  # 3 of 6 skipped: rewrite recommended
    assert check["skipped_share"].severity == dg.AssetCheckSeverity.WARN
    assert "skip more than 10% of their samples: " in check["skipped_share"].description
    assert "3 of 6 (50%)" in check["skipped_share"].description
    share = check["skipped_share"].metadata
    per_reason = {r.data["reason"]: (r.data["samples"], r.data["share"], r.data["applied"])
                  for r in share["per_reason"].value.records}
    assert per_reason == {"dedup": (2, 0.3333, "by default"),
                          "optout": (2, 0.3333, "by default"),
                          "no_u1": (1, 0.1667, "opt-in (when a run names it)")}
    assert share["over_by_reason"].value == {"dedup": 2, "optout": 2}
    # The source's funnel, on its last asset: a table and a chart (bars in Markdown).
    funnel = {r.data["stage"]: r.data["images"] for r in meta["funnel"].value.records}
    assert (funnel["raw"], funnel["duplicates"], funnel["skipped"],
            funnel["samples in shards"], funnel["streamed by loader"]) == (6, 2, 3, 6, 3)
    chart = meta["funnel_chart"].value
    assert chart.startswith("**web: where the images go**") and len(chart) < 1000
    assert "| streamed by loader | 3 | " in chart
    assert meta["streamed_share_of_raw"].value == "50.0 %"
    assert meta["opt_in_lists"].value == "no_u1 1 (skipped only when named)"
    # The warning shows on the run itself, as a tag the Runs page lists.
    assert tag_run_with_warnings(instance, run.run_id) == {
        WARNINGS_TAG: "1: skip_lists:skipped_share"}
    assert instance.get_run_by_id(run.run_id).tags[WARNINGS_TAG] == "1: skip_lists:skipped_share"


def _requested(result) -> list[tuple[str, str | None]]:
    requests = result.run_requests if hasattr(result, "run_requests") else []
    return sorted((r.asset_selection[0].path[-1], r.partition_key) for r in requests)


def _materialization(result, name):
    for event in result.get_asset_materialization_events():
        materialization = event.event_specific_data.materialization
        if materialization.asset_key.path[-1] == name:
            return materialization.metadata
    raise AssertionError(f"{name} not materialised")
