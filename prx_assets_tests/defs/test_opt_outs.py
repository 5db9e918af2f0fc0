"""Every opt-out reader goes through the one resolver: once the audited `opt_outs` table
holds the three doors' requests, the sensor, `skip_lists`, the `opt_outs_applied` check and
the loader's guard take the same ids from it, and none parses a request file or matches a
request again."""

import dagster as dg

from prx_assets.cli import main
from prx_assets.defs.opt_outs import build_opt_out_sensor, build_rights_sensor
from prx_assets.defs.resources import StorageResource
from prx_assets.defs.skip_lists import SkipListsConfig, _reasons
from prx_assets.loader import opt_out_guard
from prx_assets.stages.opt_outs import resolution
from prx_assets.stages.opt_outs.guard import recorded_opt_outs
from prx_assets.stages.opt_outs.requests import RequestFile, write_request
from prx_assets.storage.layout import Storage
from prx_assets.testing.opt_outs import opt_out, record_opt_outs, write_raw_ids
from prx_assets.testing.sources import write_sources

IDS = [f"web:{i}" for i in range(6)]


def refuse(*args, **kwargs):
    raise AssertionError("a reader parsed or matched a request the table holds")


def test_every_reader_takes_the_tables_resolution(data_root, tmp_path, monkeypatch):
    storage = Storage(data_root)
    write_raw_ids(data_root, "web", IDS)
    opt_out(data_root, "ticket-1.jsonl", IDS[1])
    assert main(["opt-out", IDS[2], "--reason", "t2"]) == 0
    write_request(storage, IDS[3], "t3", door="browser", requested_by="alice")
    record_opt_outs(data_root, ["web"])
    monkeypatch.setattr(resolution, "resolve", refuse)
    monkeypatch.setattr(RequestFile, "parse", refuse)
    opted = {IDS[1], IDS[2], IDS[3]}

    only_opt_outs = SkipListsConfig(skip_labels=[], dedup=False, semdedup=False,
                                    balance=False, ablations=False)
    reasons, lineage = _reasons(None, only_opt_outs, storage, "web", ["web"], ("c", "l"))
    assert reasons == {"optout": opted} and lineage["opt_out_requests"] == 3

    assert set(recorded_opt_outs(storage)) == opted  # the opt_outs_applied check's
    assert opt_out_guard(storage, []).ids == opted  # the loader's

    sources = write_sources(tmp_path / "s.yaml", [
        f"{{name: web, kind: image_folder, uri: {tmp_path}}}"])
    sensor = build_opt_out_sensor(str(sources))
    tick = sensor(dg.build_sensor_context(instance=dg.DagsterInstance.ephemeral(),
                                          resources={"storage": StorageResource()}))
    assert sorted((r.asset_selection[0].path[-1], r.partition_key)
                  for r in tick.run_requests) == [("opt_outs", None), ("skip_lists", "web")]


def test_the_rights_sensor_requests_skip_lists_when_domains_or_clearances_change(
        data_root, tmp_path):
    from prx_assets.stages.opt_outs.rights import clear, domains_dir

    sources = write_sources(tmp_path / "s.yaml", [
        f"{{name: web, kind: image_folder, uri: {tmp_path}}}",
        f"{{name: pics, kind: image_folder, uri: {tmp_path}}}"])
    sensor = build_rights_sensor(str(sources))

    def tick(cursor):
        return sensor(dg.build_sensor_context(cursor=cursor,
                                              instance=dg.DagsterInstance.ephemeral(),
                                              resources={"storage": StorageResource()}))

    first = tick(None)  # no cursor yet: every source once
    assert sorted(r.partition_key for r in first.run_requests) == ["pics", "web"]
    assert not tick(first.cursor).run_requests
    (domains_dir(Storage(data_root)) / "list.txt").write_text("reserved.example\n")
    listed = tick(first.cursor)
    assert len(listed.run_requests) == 2 and listed.cursor != first.cursor
    clear(Storage(data_root), ["web:1"], "policy read", door="cli")
    cleared = tick(listed.cursor)
    assert {r.asset_selection[0].path[-1] for r in cleared.run_requests} == {"skip_lists"}
    assert cleared.cursor not in (first.cursor, listed.cursor)
