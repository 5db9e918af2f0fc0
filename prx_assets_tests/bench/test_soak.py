"""Five cycles of the fault soak with a fixed seed (issue 47): one small source, the cycle
kinds that run in the test's own process (plain runs and captioner changes), the runs
without Dagster's asset checks (tested with the jobs), every soak invariant checked after
every cycle. The kill and concurrent-run kinds start processes of their own (seconds of
imports each) and are left to `python -m bench.soak`."""

from __future__ import annotations

import os
from unittest import mock

import pytest

from bench.soak import Soak, main, soak

# `python -m bench.soak --cycles 5 --seed 47 --sources web --kinds plain:3,captioner:1
# --no-asset-checks` replays it. Seed 47 draws two captioner changes (cycle 1: a caption the
# classifier labels `text`, every sample skipped; cycle 3: a `visual` one, streamed), an
# opt-out through the CLI and one through a dropped file, a hostile file, swaps, a removal,
# and a trainer streaming through every cycle's runs.
SEED = 47
CYCLES = 5


@pytest.mark.e2e  # the per-source graph, run after run: in `make test` and `make test-soak`
def test_five_cycles_of_a_fixed_seed_keep_every_invariant(tmp_path, ray_session,
                                                         fresh_shared_memory):
    state = Soak(tmp_path, SEED, kinds={"plain": 3, "captioner": 1}, source_names=("web",),
                 asset_checks=False)
    with mock.patch.dict(os.environ):  # the soak sets its instance, data root, canaries
        try:
            soak(state, CYCLES)
        finally:
            for server in state.servers:
                server.close()
    assert len(state.cycle_seconds) == CYCLES and state.failed_runs == 0
    assert state.captioner_version == 2 and state.opted, "\n".join(state.schedule)


@pytest.mark.e2e
@pytest.mark.soak  # minutes of CPU with the S3 server's start: `make test-soak` only
def test_two_cycles_with_the_data_root_in_a_bucket_keep_every_invariant(
        tmp_path, s3_server, s3_root, ray_session, fresh_shared_memory):
    """`--s3`: the same invariants read through the storage layer from the S3 test server
    (trees and tables in the bucket, nothing under the local data root), the server's own
    credentials among the values scanned for."""
    from prx_assets.testing.s3_runs import keys_under

    state = Soak(tmp_path, SEED, kinds={"plain": 1}, source_names=("web",),
                 asset_checks=False, s3_root=s3_root)
    with mock.patch.dict(os.environ):
        soak(state, 2)
    assert len(state.cycle_seconds) == 2 and state.failed_runs == 0, "\n".join(state.schedule)
    assert s3_server.secret_key in state.secrets() and s3_server.access_key in state.secrets()
    assert "mds/web.current.json" in keys_under(s3_server, s3_root)
    assert not state.data_root.exists()


def test_the_cycle_kinds_and_sources_asked_are_checked_before_anything_starts(tmp_path, capsys):
    for argv in (["--kinds", "plain,partitions", "--sources", "web"],  # needs two sources
                 ["--kinds", "plain:2,nap"], ["--kinds", "plain:x"], ["--sources", "web,ftp"]):
        with pytest.raises(SystemExit):
            main([*argv, "--dir", str(tmp_path)])
    assert "needs two sources" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
