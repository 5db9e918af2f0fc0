"""Races on one source's MDS tree, with real processes lined up by barriers
(`storage.failpoints`), never by timers: two mds_shards builds, and mds_shards beside
skip_lists, on local disk and on the S3 test server; a reader streaming one tree through
three rebuilds; the tree check on a missing or short shard; a killed holder's lease taken
over.

Writer "a" is held at `mds.write_part` (its version half-built, the current tree's shards
and sidecars already carried into it); writer "b" starts then. Where "b" has to wait for
the tree lease it is held at `leases.waiting` until "a" is done; where it does not wait, it
runs to its end first, which is the interleaving that lost data before the leases.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from prx_assets.loader import build_dataset
from prx_assets.stages.shards import mds, verify
from prx_assets.stages.skip_lists.skip_lists import skipped_ids
from prx_assets.storage import failpoints, trees
from prx_assets.storage.lance_tables import overwrite_rows
from prx_assets.storage.layout import Storage
from prx_assets.testing.mds_corpus import WRITE_OPTIONS as OPTIONS
from prx_assets.testing.mds_corpus import add_sample, build_corpus, inputs_for
from prx_assets.testing.s3_writers import wait_until
from prx_assets.testing.tree_writers import Writer

pytestmark = pytest.mark.e2e  # builds and skip lists in subprocesses

HELD, WAITING = "mds.write_part", "leases.waiting"


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def root(request, tmp_path, monkeypatch) -> str:
    """A data root with a built tree of `web` (small shards, several leaves)."""
    local = tmp_path / "data"
    if request.param == "local":
        monkeypatch.setenv("PRX_DATA_ROOT", str(local))
        root = str(local)
        build_corpus(local, "web", per_shape=4)
    else:
        root = request.getfixturevalue("s3_root")
        build_corpus(local, "web", per_shape=4)
        for name in ("bucketed_images", "captions"):
            table = Storage(str(local)).table(name, "web").to_table()
            overwrite_rows(Storage(root).table(name, "web"), table, table.schema)
    mds.write_mds_tree(inputs_for(root, "web"), root, "web", OPTIONS)
    return root


def barrier(folder: Path, name: str) -> dict[str, str]:
    # Set directly: `leases.waiting` is not a point of the code before the leases, and
    # that code must run these tests to their failing assertion, not to a setup error.
    return {failpoints.ENV_BARRIERS: name, failpoints.ENV_BARRIER_DIR: str(folder)}


def mapped_ids(root: str) -> set[str]:
    return set(Storage(root).table("mds_samples", "web").to_table(columns=["id"])["id"]
               .to_pylist())


def assert_tree_whole(root: str, log: list[str] | None = None) -> None:
    checks, problems = verify.verify_tree(root, "web", (log if log is not None else []).append)
    assert all(c.ok for c in checks) and not problems, (checks, problems)


@pytest.mark.timeout(900)
def test_two_mds_builds_of_one_source_keep_both_changes_and_a_whole_tree(root, tmp_path):
    before = mapped_ids(root)
    add_sample(root, "web:1-64x64-9001")  # what "a" plans
    # "b" sees a second new sample, added while "a" is held.
    a, b = race_after(tmp_path, root, ["mds", root],
                      lambda: add_sample(root, "web:1-64x64-9002"))
    a.result(), b.result()
    assert "waiting for" in b.output()  # b waited for a's tree lease
    assert mapped_ids(root) == before | {"web:1-64x64-9001", "web:1-64x64-9002"}
    assert_tree_whole(root)


def race_after(tmp_path: Path, root: str, b_args: list[str], between) -> tuple[Writer, Writer]:
    """"a" (an mds build) held mid-build; `between()`; "b" started, then either waiting
    for the lease or finished; "a" released, then "b". Returns both, finished."""
    folder = tmp_path / "barriers"
    folder.mkdir()
    a = Writer(["mds", root], barrier(folder, HELD), tmp_path / "a.log")
    writers = [a]
    try:
        wait_until(lambda: failpoints.ready_at_barrier(folder, HELD), [a], "a held mid-build")
        between()
        b = Writer(b_args, barrier(folder, WAITING), tmp_path / "b.log")
        writers.append(b)
        wait_until(lambda: failpoints.ready_at_barrier(folder, WAITING) or not b.alive(), [a],
                   "b waiting for the lease, or done")
        failpoints.release_barrier(folder, HELD)
        a.process.wait(600)
        failpoints.release_barrier(folder, WAITING)
        b.process.wait(600)
        return a, b
    finally:
        for writer in writers:
            writer.kill()


@pytest.mark.timeout(900)
def test_skip_lists_beside_an_mds_build_keep_their_sidecars_in_the_published_tree(root,
                                                                                 tmp_path):
    victim = sorted(mapped_ids(root))[0]
    add_sample(root, "web:1-64x64-9001")
    a, b = race_after(tmp_path, root, ["skip", root, victim], lambda: None)
    a.result(), b.result()
    assert "waiting for" in b.output()
    current = trees.source_trees(Storage(root).mds_root, "web").current_tree()
    mapping = Storage(root).table("mds_samples", "web")
    assert set(skipped_ids(current, mapping, ["dedup"]).to_pylist()) == {victim}
    assert "web:1-64x64-9001" in mapped_ids(root)
    assert_tree_whole(root)


def test_a_reader_finishes_its_epoch_through_three_rebuilds(data_root):
    build_corpus(data_root, "web", per_shape=6)
    # Small shards (a few samples each), so the reader opens shards long after it started;
    # no retention: only its reader lease keeps the tree it reads.
    options = dataclasses.replace(OPTIONS, size_limit=6_000, incremental=False,
                                  retention=timedelta(0))
    first = mds.write_mds_tree(inputs_for(data_root, "web"), data_root, "web", options)
    dataset = build_dataset(data_root / "mds", 1, 1, weights={"web": 1.0}, shuffle=False,
                            skip_reasons=())
    samples = iter(dataset)
    seen = [next(samples)["id"]]
    for _ in range(3):
        rebuilt = mds.write_mds_tree(inputs_for(data_root, "web"), data_root, "web", options)
        assert rebuilt.tree_version != first.tree_version
    seen += [sample["id"] for sample in samples]
    assert first.path.exists()
    expected = {i for i in mapped_ids(str(data_root)) if i.startswith("web:1-")}
    assert sorted(seen) == sorted(expected)
    # Released, the tree goes at the next build (past the zero retention).
    assert dataset.reader_leases is not None
    dataset.reader_leases.release()
    mds.write_mds_tree(inputs_for(data_root, "web"), data_root, "web", options)
    assert not first.path.exists()


def test_the_tree_check_fails_on_a_missing_or_short_shard(data_root):
    build_corpus(data_root, "web", per_shape=4)
    report = mds.write_mds_tree(inputs_for(data_root, "web"), data_root, "web", OPTIONS)
    assert_tree_whole(str(data_root))
    shards = sorted(Path(report.path).rglob("shard.*.mds"))
    with open(shards[0], "r+b") as shard:
        shard.truncate(shards[0].stat().st_size - 10)
    shards[1].unlink()
    _, problems = verify.verify_tree(data_root, "web")
    assert any("has" in p and "bytes, the index says" in p for p in problems), problems
    assert any(p.endswith("is missing") for p in problems), problems


_HOLDER = """
import sys
from pathlib import Path
from prx_assets.stages.shards import mds
from prx_assets.testing.mds_corpus import WRITE_OPTIONS as OPTIONS
from prx_assets.testing.mds_corpus import inputs_for
root = Path(sys.argv[1])
mds.write_mds_tree(inputs_for(root, "web"), root, "web", OPTIONS)
"""


def test_a_killed_holders_lease_expires_and_the_next_build_takes_over(data_root, tmp_path):
    build_corpus(data_root, "web", per_shape=3)
    mds.write_mds_tree(inputs_for(data_root, "web"), data_root, "web", OPTIONS)
    add_sample(data_root, "web:1-64x64-9001")
    marker = tmp_path / "marker.json"
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "PRX_LEASE_TTL_S": "1",
           **failpoints.env(HELD, marker)}
    child = subprocess.Popen([sys.executable, "-c", _HOLDER, str(data_root)], env=env)
    try:
        while failpoints.read_marker(marker) is None:  # held at the point with its lease
            assert child.poll() is None, "the holder exited before the failpoint"
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(0.1)
    finally:
        child.kill()
        child.wait()
    log: list[str] = []
    report = mds.write_mds_tree(inputs_for(data_root, "web"), data_root, "web", OPTIONS,
                                log=log.append)
    assert any("took over from" in line and f"pid {child.pid}" in line for line in log), log
    assert report.processed == 1 and "web:1-64x64-9001" in mapped_ids(str(data_root))
    assert_tree_whole(str(data_root))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("root", [pytest.param("s3", marks=pytest.mark.s3)], indirect=True)
def test_skip_lists_killed_mid_version_on_s3_leave_the_tree_and_the_rerun_applies(root,
                                                                                 tmp_path):
    """On an object store skip lists make a new tree version: killed with half its sidecars
    staged, the tree it started from stays current and whole (the check, which reads under
    the tree writers' lease, takes over the killed writer's); the rerun publishes the
    lists."""
    victim = sorted(mapped_ids(root))[0]
    store = trees.source_trees(Storage(root).mds_root, "web")
    mapping = Storage(root).table("mds_samples", "web")
    before = store.current_version()
    marker = tmp_path / "marker.json"
    killed = Writer(["skip", root, victim],  # a lease that expires a second after the kill
                    {"PRX_LEASE_TTL_S": "1",
                     **failpoints.env("skip_lists.sidecar_staged", marker)},
                    tmp_path / "killed.log")
    try:
        wait_until(lambda: failpoints.read_marker(marker) is not None, [killed],
                   "skip lists held with a sidecar staged")
    finally:
        killed.kill()
    assert store.current_version() == before
    log: list[str] = []
    assert_tree_whole(root, log)
    assert any("took over from" in line for line in log), log
    assert set(skipped_ids(store.current_tree(), mapping, ["dedup"]).to_pylist()) == set()

    # The rerun renews its own lease at the default pace (a 1 s lease can lapse on a loaded
    # machine while the version is copied; the run then stops, committing nothing).
    rerun = Writer(["skip", root, victim], {}, tmp_path / "rerun.log")
    assert rerun.result()["skipped"] == 1
    assert store.current_version() != before
    assert set(skipped_ids(store.current_tree(), mapping, ["dedup"]).to_pylist()) == {victim}
    assert_tree_whole(root)
