"""Leases in the storage: exclusive create, a holder named when the wait runs out, takeover
of an expired lease or of one whose holder's process is gone from this machine, a lost lease
refusing commits; the same on local disk and on the S3 test server (whose conditional puts
are checked first, directly). Reader leases and the retention of trees."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta

import pytest

from prx_assets.storage.layout import Storage
from prx_assets.storage.leases import (
    Lease,
    LeaseBody,
    LeaseHeldError,
    LeaseLostError,
    Owner,
    current_run_id,
    held_versions,
    lease_file,
    take_reader_lease,
    writer_lease,
)
from prx_assets.storage.refs import Location
from prx_assets.storage.trees import TreeStore, hold_current_tree, new_tree_version


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def root(request, tmp_path) -> Location:
    if request.param == "local":
        return Storage(str(tmp_path / "data")).location()
    return Storage(request.getfixturevalue("s3_root")).location()


def test_the_s3_test_server_implements_conditional_create_and_replace(s3_server):
    """SeaweedFS (the test server): If-None-Match: * refuses an existing key, If-Match
    refuses a stale ETag and accepts the current one. The S3 lease relies on exactly this."""
    import botocore.exceptions as bx

    client = s3_server.client()
    s3_server.create_bucket("prx-tests")
    key = f"lease-probe-{time.time_ns()}"
    first = client.put_object(Bucket="prx-tests", Key=key, Body=b"1", IfNoneMatch="*")
    with pytest.raises(bx.ClientError) as refused:
        client.put_object(Bucket="prx-tests", Key=key, Body=b"2", IfNoneMatch="*")
    assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    second = client.put_object(Bucket="prx-tests", Key=key, Body=b"3", IfMatch=first["ETag"])
    with pytest.raises(bx.ClientError) as stale:
        client.put_object(Bucket="prx-tests", Key=key, Body=b"4", IfMatch=first["ETag"])
    assert stale.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    assert client.get_object(Bucket="prx-tests", Key=key)["Body"].read() == b"3"
    assert second["ETag"] != first["ETag"]


def test_a_second_writer_fails_naming_the_holder_then_gets_the_released_lease(root):
    token = current_run_id.set("run-1234")
    try:
        holder = writer_lease(root, "mds_shards", "web", wait_s=60).acquire()
    finally:
        current_run_id.reset(token)
    with pytest.raises(LeaseHeldError) as held:
        writer_lease(root, "mds_shards", "web", wait_s=0).acquire()
    assert "run run-1234" in str(held.value) and "pid" in str(held.value)
    # Another asset or another source is another lease.
    writer_lease(root, "skip_lists", "web", wait_s=0).acquire().release()
    writer_lease(root, "mds_shards", "other", wait_s=0).acquire().release()
    holder.release()
    with writer_lease(root, "mds_shards", "web", wait_s=0) as second:
        second.check()


def test_an_expired_lease_is_taken_over_and_its_old_holder_may_not_commit(root):
    location = root / "leases" / "writers" / "mds_shards" / "web.json"
    dead = Owner("elsewhere", 1, "run-dead", "token-dead")
    expired = LeaseBody(location.uri, dead, time.time() - 100, time.time() - 1)
    assert lease_file(location).create(expired.encode()) is not None  # a killed holder's
    taken: list[str] = []
    with Lease(location, wait_s=0, log=taken.append) as lease:
        assert any("took over from run run-dead" in line for line in taken)
        lease.check()
        # Its own lease stolen (as if it had expired and another writer took over): the
        # renewal notices and a commit check refuses.
        current = lease_file(location).read()
        assert current is not None
        thief = LeaseBody(location.uri, Owner("x", 2, None, "t"), time.time(), time.time() + 60)
        assert lease_file(location).replace(thief.encode(), current[1]) is not None
        lease.renew()
        with pytest.raises(LeaseLostError, match="replaced by another owner"):
            lease.check()
    # The thief's lease is left as it was: the old holder does not release it.
    data = lease_file(location).read()
    assert data is not None and json.loads(data[0])["owner"]["token"] == "t"


HOLDER = """
import sys
from prx_assets.storage.layout import Storage
from prx_assets.storage.leases import writer_lease
writer_lease(Storage(sys.argv[1]).location(), "mds_shards", "web", ttl_s=3600).acquire()
print("held", flush=True)
sys.stdin.read()
"""


def test_a_lease_whose_holder_process_is_gone_from_this_machine_is_taken_at_once(tmp_path):
    # A run killed here (SIGKILL, the OOM killer) leaves its lease unexpired for up to its
    # time to live (an hour in this holder's case): the next writer sees the process gone.
    data = str(tmp_path / "data")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, data], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(LeaseHeldError):  # alive: it keeps its lease
            writer_lease(Storage(data).location(), "mds_shards", "web", wait_s=0).acquire()
    finally:
        holder.kill()
        holder.wait()
    taken: list[str] = []
    with writer_lease(Storage(data).location(), "mds_shards", "web", wait_s=0,
                      log=taken.append) as lease:
        lease.check()
    assert any("its process is gone from this machine" in line for line in taken)


def test_a_holder_on_another_machine_keeps_its_lease_until_it_expires(root):
    location = root / "leases" / "writers" / "mds_shards" / "web.json"
    other = LeaseBody(location.uri, Owner("elsewhere", 999_999, "run-far", "token-far"),
                      time.time(), time.time() + 3600,
                      process="another-boot:pid:[1]/999999/12345")  # no such pid here
    assert lease_file(location).create(other.encode()) is not None
    with pytest.raises(LeaseHeldError, match="run run-far"):
        Lease(location, wait_s=0).acquire()


def test_the_heartbeat_keeps_a_short_lease_alive(tmp_path):
    root = Storage(str(tmp_path / "data")).location()
    # Short, so a renewal comes soon; long enough that a busy machine's late heartbeat
    # does not let it lapse between the renewal seen and the check.
    with writer_lease(root, "captions", "web", ttl_s=3.0, wait_s=0) as lease:
        first = lease._body
        assert first is not None
        # Wait on the lease file itself, not a clock: the heartbeat rewrites it.
        file = lease_file(lease.location)
        start = file.read()
        while file.read() == start:
            time.sleep(0.05)
        lease.check()
        with pytest.raises(LeaseHeldError):
            writer_lease(root, "captions", "web", wait_s=0).acquire()


def test_reader_leases_hold_versions_until_they_expire_or_are_released(root):
    live = take_reader_lease(root, "web", "20260101T000000000000Z", 3600)
    gone = take_reader_lease(root, "web", "20260102T000000000000Z", -1)  # already expired
    assert held_versions(root, "web") == {"20260101T000000000000Z"}
    assert not gone.location.exists()  # expired lease files are cleaned on the way
    live.release()
    assert held_versions(root, "web") == set()


def _tree(store: TreeStore, version: str) -> None:
    (store.tree(version) / "tree.json").write_text("{}")


def test_prune_keeps_the_current_tree_recent_ones_and_leased_ones(tmp_path):
    storage = Storage(str(tmp_path / "data"))
    store = TreeStore(storage.mds_root, "web")
    store.prepare()
    day = timedelta(days=1)
    now = datetime(2026, 6, 30, tzinfo=UTC)
    versions = [(now - age).strftime("%Y%m%dT%H%M%S%fZ") for age in (20 * day, 15 * day,
                                                                        10 * day, day)]
    for version in versions:
        _tree(store, version)
    store.publish(versions[-1], expected=None)
    take_reader_lease(storage.location(), "web", versions[0], 3600)
    removed = store.prune(timedelta(days=7), now=now)
    # [0] superseded 15 days ago but leased; [1] superseded 10 days ago: removed; [2]
    # superseded a day ago: within retention; [3] current.
    assert removed == [versions[1]]
    assert store.versions() == [versions[0], versions[2], versions[3]]


def test_mds_uri_with_a_lease_holds_the_tree_it_prints(data_root, capsys):
    from prx_assets import cli

    store = TreeStore(Storage(str(data_root)).mds_root, "web")
    store.prepare()
    version = new_tree_version()
    _tree(store, version)
    store.publish(version, expected=None)
    assert cli.main(["mds-uri", "web", "--lease", "2"]) == 0
    out = capsys.readouterr()
    assert out.out.strip() == str(store.tree(version).path.resolve())
    assert f"holds tree {version}" in out.err and "reader lease" in out.err
    assert held_versions(Storage(str(data_root)).location(), "web") == {version}
    tree, lease = hold_current_tree(Storage(str(data_root)).mds_root, "web", 60)
    assert tree.name == version and lease.expires_at > time.time()


def test_mds_uri_with_a_lease_holds_a_subset_tree_past_its_retention(data_root, capsys):
    """Before: `mds-uri --subset NAME --lease` refused, and a subset's prune knew no
    reader leases (it looked for them under the MDS root)."""
    from prx_assets import cli
    from prx_assets.stages.subsets.tree import subset_store

    storage = Storage(str(data_root))
    store = subset_store(storage.mds_root, "web")  # named as a source: leases kept apart
    store.prepare()
    old, new = "20260101T000000000000Z", "20260102T000000000000Z"
    _tree(store, old)
    store.publish(old, expected=None)
    assert cli.main(["mds-uri", "--subset", "web", "--lease", "2"]) == 0
    out = capsys.readouterr()
    assert out.out.strip() == str(store.tree(old).path.resolve())
    assert f"holds tree {old}" in out.err
    assert held_versions(storage.location(), "web") == set()  # not the source's
    _tree(store, new)
    store.publish(new, expected=old)
    assert store.prune(timedelta(0)) == [] and store.versions() == [old, new]
