"""Commit races and kills on the S3 server, with real processes lined up by barriers and
failpoints (`storage.failpoints`), never by timers."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from prx_assets.storage import failpoints, lance_tables, object_store
from prx_assets.storage.lance_tables import CommitConflictError, upsert
from prx_assets.storage.layout import Storage
from prx_assets.storage.refs import TableRef
from prx_assets.storage.tables import CAPTIONS
from prx_assets.testing.s3_writers import (
    SCHEMA,
    WriterProcess,
    chunk_ids,
    replaced_ids,
    rows,
    wait_until,
)

pytestmark = pytest.mark.e2e  # writers in subprocesses

POINT = "storage.upsert_uncommitted"


def table_rows(uri: TableRef, version: int | None = None) -> dict[str, int]:
    table = uri.at(version).to_table().to_pydict()
    assert len(table["id"]) == len(set(table["id"])), "duplicate ids"
    return dict(zip(table["id"], table["v"], strict=True))


def data_files_in_bucket(server, uri: str) -> int:
    _, bucket, key = object_store.split_uri(uri)
    pages = server.client().get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Prefix=f"{key}/data/")
    return sum(len(page.get("Contents", [])) for page in pages)


@pytest.mark.timeout(900)
def race_two_writers(s3_server, tmp_path: Path, verb: str, uri: TableRef, point: str,
                     what: str) -> tuple[list[WriterProcess], list[dict]]:
    """Writers "a" and "b" doing `verb` on `uri`, both held at the barrier `point` until
    both reach it, then released together; their processes and results."""
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    env = {**s3_server.env(), **failpoints.barrier_env(point, barrier)}
    writers = [WriterProcess([verb, str(uri), name], env, tmp_path / f"{name}.log")
               for name in ("a", "b")]
    wait_until(lambda: len(failpoints.ready_at_barrier(barrier, point)) == 2, writers, what)
    failpoints.release_barrier(barrier, point)
    return writers, [writer.result() for writer in writers]


def test_two_processes_committing_at_once_both_land_and_the_loser_retried(
        s3_server, s3_root, tmp_path: Path):
    """Both writers read version 1 and write their files, then wait at the barrier; released
    together, one commit wins, the other's conditional put of the same version fails and it
    merges again on top. Final table: every row of both, `shared` once, three versions."""
    uri = Storage(s3_root).table(CAPTIONS, "web")
    upsert(uri, rows(["shared"], 0), SCHEMA, ["id"])
    writers, results = race_two_writers(s3_server, tmp_path, "upsert", uri, POINT,
                                        "both writers wrote their files")

    final = table_rows(uri)
    assert sorted(final) == ["a0", "a1", "a2", "b0", "b1", "b2", "shared"]
    assert final["shared"] in (sum(b"a"), sum(b"b"))
    assert uri.latest_version() == 3 and sorted(r["version"] for r in results) == [2, 3]
    retried = [w for w in writers if "lost its commit" in w.output()]
    assert len(retried) == 1, [w.output()[-2000:] for w in writers]


@pytest.mark.timeout(900)
def test_two_whole_table_rewrites_at_once_one_commits_the_other_fails_clearly(
        s3_server, s3_root, tmp_path: Path):
    """Two runs replacing one table (`write_dataset_atomically`), both started from version
    1 and held at the barrier with every fragment written: one commit wins, the other fails
    with CommitConflictError naming the table; the table is exactly the winner's rows."""
    uri = Storage(s3_root).table(CAPTIONS, "web")
    upsert(uri, rows(["old"], 0), SCHEMA, ["id"])
    _, results = race_two_writers(s3_server, tmp_path, "overwrite", uri,
                                  "storage.overwrite_uncommitted",
                                  "both writers wrote their fragments")

    [winner] = [n for n, r in zip("ab", results, strict=True) if "version" in r]
    [loser] = [r for r in results if "conflict" in r]
    conflict = loser["conflict"]
    assert uri.uri in conflict and "another writer committed version 2" in conflict
    assert table_rows(uri) == {f"{winner}{i}": sum(winner.encode()) for i in range(5)}
    assert uri.latest_version() == 2 and sorted(table_rows(uri, 1)) == ["old"]


def test_an_upsert_that_loses_every_commit_fails_naming_the_table_and_keeps_the_winner(
        s3_server, s3_root, monkeypatch):
    """The loser's merge is preempted on each attempt (here: its one attempt): it raises a
    clear error, and the table holds the winner's rows, none of the loser's."""
    uri = Storage(s3_root).table(CAPTIONS, "web")
    upsert(uri, rows(["shared"], 0), SCHEMA, ["id"])
    monkeypatch.setattr(lance_tables, "UPSERT_ATTEMPTS", 1)
    winner_ran = []

    def another_writer_commits_first(name: str) -> None:
        if not winner_ran:
            winner_ran.append(name)
            upsert(uri, rows(["winner", "shared"], 1), SCHEMA, ["id"])

    monkeypatch.setattr(lance_tables, "failpoint", another_writer_commits_first)
    with pytest.raises(CommitConflictError, match="lost the commit to concurrent writers") as err:
        upsert(uri, rows(["loser", "shared"], 2), SCHEMA, ["id"])
    assert uri.uri in str(err.value)
    assert table_rows(uri) == {"shared": 1, "winner": 1}


@pytest.mark.timeout(900)
def test_a_chunked_run_killed_mid_commit_leaves_the_table_readable_and_the_rerun_completes(
        s3_server, s3_root, tmp_path: Path):
    """SIGKILL (the writer and its Ray) after chunk 1 committed and chunk 2's files were put
    in the bucket, before its commit: the table reads at version 1 with chunk 1's rows; the
    rerun writes only the rest, with no duplicate id."""
    uri = Storage(s3_root).table(CAPTIONS, "web")
    marker = tmp_path / "marker.json"
    env = {**s3_server.env(), **failpoints.env(POINT, marker)}
    killed = WriterProcess(["chunked", str(uri), "12", "4"], env, tmp_path / "killed.log")
    wait_until(lambda: failpoints.read_marker(marker) is not None, [killed],
               "the second chunk's files were written")
    killed.kill()

    at_kill = table_rows(uri)
    assert uri.latest_version() == 1 and len(at_kill) == 4
    referenced = sum(len(f.data_files()) for f in uri.open().get_fragments())
    assert data_files_in_bucket(s3_server, uri.uri) > referenced  # chunk 2's uncommitted files

    rerun = WriterProcess(["chunked", str(uri), "12", "4"], s3_server.env(), tmp_path / "rerun.log")
    result = rerun.result()
    assert result["committed"] == 8  # only what the killed run had not committed
    final = table_rows(uri)
    assert sorted(final) == chunk_ids(12)
    assert all(final[i] == 1 for i in at_kill)


class _LocalDisk:
    """Stands in for the S3 server where a race runs on local disk: no variables to add."""

    def env(self) -> dict[str, str]:
        return {}


@pytest.mark.parametrize(("existing", "verb"), [
    ([], "replace"), (["s0", "s1", "s9"], "replace"), (["s0", "s1", "s9"], "replace-ids")],
    ids=["first", "replacing", "replacing-by-id"])
@pytest.mark.parametrize("store", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_two_replacements_of_one_source_never_double_or_lose_its_rows(
        request, tmp_path: Path, existing: list[str], verb: str, store: str):
    """Two `corpus` writers replacing one source's rows (`replace_where`), both planned on
    the same version and held at the barrier before their one commit: one wins, the other
    is preempted and redoes its deletes on top. The source ends with exactly one writer's
    rows, once each; the other source's row is kept. (On the old delete + append, both
    appends landed: every row twice.) By id, as a corpus update deletes (the ids it writes
    and those it removes), the same holds: the loser's filter names the ids both added."""
    server = request.getfixturevalue("s3_server") if store == "s3" else _LocalDisk()
    root = request.getfixturevalue("s3_root") if store == "s3" else str(tmp_path / "data")
    uri = Storage(root).table("corpus")
    upsert(uri, pa.concat_tables([rows(["keep"], 0), rows(existing, 1)]), SCHEMA, ["id"])
    writers, results = race_two_writers(server, tmp_path, verb, uri,
                                        "storage.replace_uncommitted",
                                        "both writers planned their replacement")
    final = table_rows(uri)
    assert sorted(final) == ["keep", *replaced_ids()]
    assert final["keep"] == 0 and len({final[i] for i in replaced_ids()}) == 1
    assert sorted(r["deleted"] for r in results) == sorted([len(existing), 5])
    retried = [w for w in writers if "lost its commit" in w.output()]
    assert len(retried) == 1, [w.output()[-2000:] for w in writers]
