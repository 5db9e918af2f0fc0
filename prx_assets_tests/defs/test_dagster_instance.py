"""One Dagster instance wherever a command runs: the repo's dagster.yaml keeps runs, event
logs and compute logs under DAGSTER_HOME, not under the working directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest
from dagster._core.instance.ref import InstanceRef

REPO = Path(__file__).resolve().parents[2]

ONE_ASSET = '''
import dagster as dg

@dg.asset
def one() -> int:
    return 1

defs = dg.Definitions(assets=[one])
'''


@pytest.mark.e2e  # a `dagster` command runs the asset
def test_a_dagster_command_from_another_folder_records_its_run_in_dagster_home(tmp_path):
    home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
    home.mkdir()
    elsewhere.mkdir()
    (home / "dagster.yaml").write_text((REPO / "dagster.yaml").read_text())
    (elsewhere / "one.py").write_text(ONE_ASSET)
    env = {**os.environ, "DAGSTER_HOME": str(home)}
    done = subprocess.run([sys.executable, "-m", "dagster", "asset", "materialize", "-f",
                           "one.py", "--select", "one"], cwd=elsewhere, env=env,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]

    with dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(home))) as instance:
        runs = instance.get_runs()
        assert len(runs) == 1 and runs[0].is_success
        assert instance.get_latest_materialization_event(dg.AssetKey("one")) is not None
    assert sorted(p.name for p in elsewhere.iterdir() if p.name != "__pycache__") == ["one.py"]


def test_every_job_runs_its_steps_in_the_run_process(tmp_path):
    """Runs launched by the daemon (UI, sensors, automation) use the job's executor: one
    process per run, not a process per asset and check (each re-importing the package and
    starting Ray); independent steps at the same time in its threads (defs/executor.py)."""
    from prx_assets.definitions import build_defs
    from prx_assets.testing.sources import write_sources

    sources = write_sources(tmp_path / "sources.yaml",
                            [f"{{name: web, kind: image_folder, uri: {tmp_path}}}"])
    defs = build_defs(sources)
    jobs = [*defs.resolve_all_job_defs(), defs.resolve_implicit_global_asset_job_def()]
    assert {"source_job", "__ASSET_JOB"} <= {job.name for job in jobs}
    assert {job.name: job.executor_def.name for job in jobs} == \
        {job.name: "in_process_concurrent" for job in jobs}
