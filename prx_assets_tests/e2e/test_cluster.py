"""The cluster path: a partition materialised through a real two-node Ray cluster."""

import json
import subprocess
import sys
from pathlib import Path

import lance
import pytest

from prx_assets_tests.conftest import jpeg_bytes, write_sources
from prx_assets_tests.e2e.ray_cluster import TwoNodeCluster

DRIVER = """
import json, sys
import dagster as dg
from prx_assets.defs import build_defs
job = build_defs(sys.argv[1]).resolve_job_def("corpus_job")
result = job.execute_in_process(
    partition_key="web", instance=dg.DagsterInstance.ephemeral(),
    run_config={"ops": {"raw_images": {"config": {"files_per_task": 1}}}})
meta = [e.event_specific_data.materialization.metadata
        for e in result.get_asset_materialization_events()][0]
print("RESULT" + json.dumps({"success": result.success, "nodes": meta["ray_nodes"].value,
                             "rows": meta["dagster/row_count"].value}))
"""


@pytest.mark.cluster
def test_raw_images_through_a_two_node_cluster(tmp_path: Path):
    images = tmp_path / "images"
    images.mkdir()
    for i in range(24):
        (images / f"{i:03d}.jpg").write_bytes(jpeg_bytes(480, 360, i))
    sources = write_sources(tmp_path / "sources.yaml",
                            [f"{{name: web, kind: image_folder, uri: {images}}}"])
    data_root = tmp_path / "data"
    with TwoNodeCluster() as cluster:
        env = {**cluster.driver_env(), "PRX_DATA_ROOT": str(data_root)}
        out = subprocess.run([sys.executable, "-c", DRIVER, str(sources)], env=env,
                             capture_output=True, text=True, timeout=600)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT")]
    assert lines, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT"):])
    assert result == {"success": True, "nodes": 2, "rows": 24}
    table = lance.dataset(str(data_root / "lance/raw_images/web.lance"))
    assert sorted(table.to_table(columns=["source_key"]).column(0).to_pylist()) == [
        f"{i:03d}.jpg" for i in range(24)]
