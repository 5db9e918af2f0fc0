"""The three opt-out doors (a dropped file, `prx-assets opt-out`, the browser) end in the same
audited table, and an opt-out through each is gone from a fresh loader within one sensor
tick plus the runs it requests: from the sidecars alone, not only by the loader's guard."""

from __future__ import annotations

import json

import dagster as dg
import pyarrow as pa
import pytest

from prx_assets.browser.app import create_app
from prx_assets.browser.auth import BrowserAuth, Curators
from prx_assets.cli import main
from prx_assets.definitions import build_defs
from prx_assets.loader import build_dataset
from prx_assets.stages.opt_outs.resolution import resolve_opt_outs
from prx_assets.stages.shards import mds, plan
from prx_assets.storage.lance_tables import overwrite_rows
from prx_assets.storage.layout import Storage
from prx_assets.testing.mds_corpus import build_corpus, inputs_for
from prx_assets.testing.opt_outs import write_raw_ids
from prx_assets.testing.served_app import ServedApp
from prx_assets.testing.sources import write_sources
from prx_assets_tests.browser.test_auth import Client

TOKEN = "doors-curator-token-0123456789"


pytestmark = pytest.mark.usefixtures("fresh_shared_memory")


def _streamed(root, guard: bool) -> set[str]:
    dataset = build_dataset(root / "mds", 1, 1, weights={"web": 1.0}, shuffle=False,
                            decode_images=False, guard_opt_outs=guard)
    return {sample["id"] for sample in dataset}


def _tick_and_run(defs, instance, cursor):
    """One sensor tick, then every run it requested, tagged with its key as the daemon
    does; returns the cursor after a second tick has seen them succeed."""
    sensor = defs.get_sensor_def("opt_out_sensor")
    context = {"instance": instance, "resources": {"storage": defs.resources["storage"]}}
    tick = sensor(dg.build_sensor_context(cursor=cursor, **context))
    assert tick.run_requests, "the tick requested no run"
    for request in tick.run_requests:
        asset = request.asset_selection[0]
        job = "skip_lists_job" if asset.path[-1] == "skip_lists" else "dedup_job"
        result = defs.resolve_job_def(job).get_subset(asset_selection={asset}).execute_in_process(
            partition_key=request.partition_key, instance=instance,
            tags={"dagster/run_key": request.run_key})
        assert result.success
    return sensor(dg.build_sensor_context(cursor=tick.cursor, **context)).cursor


def test_each_door_reaches_a_fresh_loader_within_one_tick_and_run(ray_session, data_root,
                                                                   tmp_path, monkeypatch):
    root = data_root
    build_corpus(root, "web", per_shape=6, shapes=((1, 48, 48), (1, 48, 64)))
    mds.write_mds_tree(inputs_for(root, "web"), root, "web",
                       plan.WriteOptions(size_limit=4_000, parallel=False))
    ids = sorted(r["id"] for r in Storage(root).table("mds_samples", "web").to_table()
                 .to_pylist())
    write_raw_ids(root, "web", ids)
    corpus = pa.table({"id": ids, "source": ["web"] * len(ids), "caption": ["c"] * len(ids)})
    overwrite_rows(Storage(root).table("corpus"), corpus, corpus.schema)
    defs = build_defs(write_sources(tmp_path / "s.yaml", [
        f"{{name: web, kind: image_folder, uri: {tmp_path}}}"]))
    instance = dg.DagsterInstance.ephemeral()
    by_file, by_cli, by_browser = ids[1], ids[4], ids[7]

    (root / "opt_outs").mkdir()
    (root / "opt_outs" / "ticket-1.jsonl").write_text(json.dumps({
        "key_type": "id", "value": by_file, "timestamp": "2026-11-01T00:00:00Z",
        "reference": "ticket-1"}) + "\n")
    cursor = _tick_and_run(defs, instance, None)
    assert by_file not in _streamed(root, guard=False)

    assert main(["opt-out", by_cli, "--reason", "ticket-2"]) == 0
    cursor = _tick_and_run(defs, instance, cursor)
    assert by_cli not in _streamed(root, guard=False)

    auth = BrowserAuth(Curators.parse(f"alice {TOKEN}"))
    with ServedApp(root, create_app(root, auth)) as served:
        client = Client(served.url)
        assert client.login(TOKEN) == 303
        _, _, page = client.request("GET", f"/sample/{by_browser}/opt-out")
        token = page.split('name="token" value="', 1)[1].split('"', 1)[0]
        assert client.request("POST", f"/sample/{by_browser}/opt-out",
                              {"token": token, "confirm": "yes", "reference": "ticket-3"}
                              )[0] == 303
    _tick_and_run(defs, instance, cursor)
    streamed = _streamed(root, guard=False)
    assert streamed == set(ids) - {by_file, by_cli, by_browser}
    assert _streamed(root, guard=True) == streamed

    audit = Storage(root).table("opt_outs").to_table().to_pylist()
    assert sorted((r["id"], r["door"], r["reference"]) for r in audit) == sorted([
        (by_file, "file", "ticket-1"), (by_cli, "cli", "ticket-2"),
        (by_browser, "browser", "ticket-3")])
    assert {r["id"]: r["requested_by"] for r in audit}[by_browser] == "alice"
    assert {r["id"]: r["requested_by"] for r in audit}[by_cli]  # the OS user
    # The table the asset wrote carries its record: the three requests are read back from
    # it, not resolved again.
    assert resolve_opt_outs(Storage(root), ["web"]).resolved_now == ()
