"""Opt-outs fail closed through Dagster: source_job ends with skip lists, the sensor's
cursor moves only once the runs it requested succeeded, and the blocking check
`opt_outs_applied` fails while an old opt-out is still streamable."""

import json
import os
import shutil
import time

import dagster as dg

from prx_assets.definitions import build_defs
from prx_assets.defs.opt_outs import read_cursor
from prx_assets.storage.lance_tables import overwrite_rows
from prx_assets.storage.layout import Storage
from prx_assets.testing.sources import write_sources
from prx_assets_tests.defs.test_dedup_skip_lists import CORPUS, _write_source

RUN_KEY = "dagster/run_key"


def _setup(data_root, tmp_path):
    sources = write_sources(tmp_path / "s.yaml", [
        f"{{name: {name}, kind: image_folder, uri: {tmp_path}}}" for name in CORPUS])
    raw = {s: _write_source(data_root, s, CORPUS[s])[0] for s in CORPUS}
    (data_root / "opt_outs").mkdir()
    return build_defs(sources), raw


def _request(data_root, name: str, sample_id: str, landed_hours_ago: float = 0.0) -> None:
    path = data_root / "opt_outs" / name
    path.write_text(json.dumps({"key_type": "id", "value": sample_id,
                                "timestamp": "2026-11-01T00:00:00Z", "reference": "t"}) + "\n")
    if landed_hours_ago:
        stamp = time.time() - landed_hours_ago * 3600
        os.utime(path, (stamp, stamp))


def _tick(defs, instance, cursor):
    sensor = defs.get_sensor_def("opt_out_sensor")
    return sensor(dg.build_sensor_context(instance=instance, cursor=cursor,
                                          resources={"storage": defs.resources["storage"]}))


def _keys(result) -> list[str]:
    return sorted(r.run_key for r in result.run_requests or [])


def _runs(result) -> list[str]:
    """What each requested run is for: `opt_outs`, or `skip_lists:<source>`."""
    return sorted(":".join(k.split(":")[:2]) if k.startswith("skip_lists") else
                  k.split(":")[0] for k in _keys(result))


def _launch(defs, instance, request: dg.RunRequest) -> bool:
    """Run what the sensor asked for, tagged with its run key as the daemon would."""
    asset = request.asset_selection[0]
    job = "skip_lists_job" if asset.path[-1] == "skip_lists" else "dedup_job"
    subset = defs.resolve_job_def(job).get_subset(asset_selection={asset})
    result = subset.execute_in_process(partition_key=request.partition_key, instance=instance,
                                       tags={RUN_KEY: request.run_key}, raise_on_error=False)
    return result.success


def test_source_job_ends_with_skip_lists(tmp_path):
    sources = write_sources(tmp_path / "s.yaml", [f"{{name: web, kind: image_folder, "
                                                  f"uri: {tmp_path}}}"])
    keys = build_defs(sources).resolve_job_def("source_job").asset_layer.executable_asset_keys
    assert dg.AssetKey("skip_lists") in keys and dg.AssetKey("mds_shards") in keys


def test_sensor_cursor_moves_only_when_its_runs_succeeded(ray_session, data_root, tmp_path):
    defs, raw = _setup(data_root, tmp_path)
    instance = dg.DagsterInstance.ephemeral()
    _request(data_root, "001.jsonl", raw["web"]["u1.jpg"]["id"])
    first = _tick(defs, instance, None)
    assert _runs(first) == ["opt_outs", "skip_lists:web"]
    # No run yet (the daemon did not create them): asked again under the same keys, and the
    # file does not count as applied.
    second = _tick(defs, instance, first.cursor)
    assert _keys(second) == _keys(first)
    assert "001.jsonl" not in read_cursor(second.cursor)[0]

    # The skip_lists run fails (its source has no mapping table): asked again, new key.
    mapping = Storage(data_root).table("mds_samples", "web")
    saved = mapping.to_table()
    shutil.rmtree(mapping.uri)
    assert [_launch(defs, instance, r) for r in sorted(second.run_requests,
                                                        key=lambda r: r.run_key)] == [
        True, False]
    third = _tick(defs, instance, second.cursor)
    assert [k.split("#")[0] for k in _keys(third)] == [k for k in _keys(first)
                                                        if k.startswith("skip_lists")]
    assert all(k.endswith("#1") for k in _keys(third))
    assert "001.jsonl" not in read_cursor(third.cursor)[0]

    overwrite_rows(mapping, saved, saved.schema)
    assert all(_launch(defs, instance, r) for r in third.run_requests)
    fourth = _tick(defs, instance, third.cursor)
    assert not fourth.run_requests
    done, pending = read_cursor(fourth.cursor)
    assert "001.jsonl" in done and pending is None
    # The next file is a new batch.
    _request(data_root, "002.jsonl", raw["stock"]["u2.jpg"]["id"])
    fifth = _tick(defs, instance, fourth.cursor)
    assert _runs(fifth) == ["opt_outs", "skip_lists:stock"]


def _check(result) -> dg.AssetCheckEvaluation:
    return next(e for e in result.get_asset_check_evaluations()
                if e.asset_check_key.name == "opt_outs_applied")


def test_opt_outs_applied_blocks_while_an_old_opt_out_streams(ray_session, data_root,
                                                                tmp_path):
    defs, raw = _setup(data_root, tmp_path)
    instance = dg.DagsterInstance.ephemeral()
    old, fresh = raw["web"]["u1.jpg"]["id"], raw["web"]["p3.jpg"]["id"]
    _request(data_root, "old.jsonl", old, landed_hours_ago=2)
    _request(data_root, "fresh.jsonl", fresh)
    reserved = raw["web"]["p1.jpg"]["id"]  # a "do not train" read at ingest
    Storage(str(data_root)).table("raw_images", "web").open().update(
        {"reservation": "'prohibited'", "reservation_signal": "'tdmrep=tdm-reservation=1'"},
        where=f"id = '{reserved}'")
    job = defs.resolve_job_def("skip_lists_job")
    applied = job.execute_in_process(partition_key="web", instance=instance)
    assert applied.success and _check(applied).passed
    assert _check(applied).metadata["pending"].value == 0
    assert _check(applied).metadata["pending_rights"].value == 0

    # Skip lists without the rights list: the reserved sample streams, the check fails.
    unreserved = job.execute_in_process(
        partition_key="web", instance=instance, raise_on_error=False,
        run_config={"ops": {"skip_lists": {"config": {"rights": False}}}})
    check = _check(unreserved)
    assert not unreserved.success and not check.passed
    assert (check.metadata["pending"].value, check.metadata["pending_rights"].value) == (0, 1)
    assert check.metadata["first_reserved_id"].value == reserved
    assert "prohibited: tdmrep" in check.metadata["first_reserved_signal"].value

    # Skip lists that leave the opt-outs out: the 2-hour-old one is streamable (the check
    # fails and, blocking, fails the run); the fresh one is within the delay.
    leaky = job.execute_in_process(
        partition_key="web", instance=instance, raise_on_error=False,
        run_config={"ops": {"skip_lists": {"config": {"opt_outs": False}}}})
    check = _check(leaky)
    assert not leaky.success and not check.passed
    assert check.metadata["pending"].value == 1
    assert check.metadata["oldest_pending_id"].value == old
    assert check.metadata["oldest_pending_request"].value == "old.jsonl:1"
    assert check.metadata["oldest_pending_hours"].value >= 1.9
    assert old in check.description
