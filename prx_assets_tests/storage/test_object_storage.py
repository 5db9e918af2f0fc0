"""Lance tables on s3:// through Storage, against a real S3-compatible server on 127.0.0.1."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pyarrow as pa
import pytest
import ray.data

from prx_assets.storage import object_store
from prx_assets.storage.lance_tables import (
    FragmentPolicy,
    append_rows,
    prepare_output_dir,
    upsert,
    write_dataset_atomically,
)
from prx_assets.storage.layout import Storage
from prx_assets.storage.object_store import ObjectStoreError, as_uri, lance_options
from prx_assets.storage.refs import TableRef
from prx_assets.storage.table_checks import duplicate_ids, fragment_health
from prx_assets.storage.table_stats import profile_table
from prx_assets.storage.tables import CAPTIONS, RAW_IMAGES
from prx_assets.testing.s3_server import TEST_BUCKET
from prx_assets.testing.sources import write_sources

SCHEMA = pa.schema([("id", pa.string()), ("v", pa.int64())])


def rows(ids, v=0) -> pa.Table:
    return pa.table({"id": list(ids), "v": [v] * len(ids)}, schema=SCHEMA)


def keys_under(server, root: str) -> list[str]:
    _, bucket, prefix = object_store.split_uri(root)
    pages = server.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return [item["Key"] for page in pages for item in page.get("Contents", [])]


# What Lance relies on from the server (docs/cluster.md): if the test server is swapped,
# these say whether the new one still qualifies.

def test_server_refuses_a_second_create_of_the_same_key(s3_server):
    client = s3_server.client()
    key = "conditional/put"
    client.put_object(Bucket=TEST_BUCKET, Key=key, Body=b"first", IfNoneMatch="*")
    with pytest.raises(client.exceptions.ClientError, match="PreconditionFailed"):
        client.put_object(Bucket=TEST_BUCKET, Key=key, Body=b"second", IfNoneMatch="*")
    assert client.get_object(Bucket=TEST_BUCKET, Key=key)["Body"].read() == b"first"


def test_server_assembles_multipart_uploads_and_lists_by_delimiter(s3_server):
    client = s3_server.client()
    part1, part2 = b"a" * (5 << 20), b"b" * 100  # parts but the last must be >= 5 MiB
    upload = client.create_multipart_upload(Bucket=TEST_BUCKET, Key="mp/big")["UploadId"]
    etags = [client.upload_part(Bucket=TEST_BUCKET, Key="mp/big", UploadId=upload,
                                PartNumber=n, Body=body)["ETag"]
             for n, body in ((1, part1), (2, part2))]
    client.complete_multipart_upload(
        Bucket=TEST_BUCKET, Key="mp/big", UploadId=upload,
        MultipartUpload={"Parts": [{"ETag": e, "PartNumber": n} for n, e in enumerate(etags, 1)]})
    assert client.get_object(Bucket=TEST_BUCKET, Key="mp/big")["Body"].read() == part1 + part2
    for key in ("ls/a/1", "ls/a/2", "ls/b/3", "ls/x"):
        client.put_object(Bucket=TEST_BUCKET, Key=key, Body=b"")
    listed = client.list_objects_v2(Bucket=TEST_BUCKET, Prefix="ls/", Delimiter="/")
    assert [p["Prefix"] for p in listed["CommonPrefixes"]] == ["ls/a/", "ls/b/"]
    assert [c["Key"] for c in listed["Contents"]] == ["ls/x"]


# Settings: no server needed.

def test_object_store_options_are_bounded_then_env_then_overrides(monkeypatch):
    assert lance_options("/local/t.lance") is None
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    options = lance_options("s3://b/t.lance", {"endpoint": "http://127.0.0.1:2", "timeout": "5s"})
    assert options["aws_endpoint"] == "http://127.0.0.1:2" and options["allow_http"] == "true"
    assert options["timeout"] == "5s" and options["client_max_retries"] == "3"
    assert Storage("s3://b/p", {"aws_region": "eu-west-1"}).settings.get("aws_region") \
        == "eu-west-1"
    assert Storage("s3://b/p").settings.get("aws_endpoint") == "http://127.0.0.1:1"


def test_a_uri_that_went_through_path_still_names_the_bucket():
    assert as_uri(Path("s3://bucket/lance/t.lance")) == "s3://bucket/lance/t.lance"
    assert as_uri(Path("/data/lance/t.lance")) == "/data/lance/t.lance"


# Tables through Storage.

def test_tables_on_s3_write_append_merge_and_read_at_versions(s3_server, s3_root):
    storage = Storage.from_env()
    assert storage.root == s3_root and not storage.is_local
    table = storage.table(CAPTIONS, "web")
    assert table.uri == f"{s3_root}/lance/captions/web.lance"
    assert table.latest_version() is None and not table.exists()
    with pytest.raises(FileNotFoundError, match=r"captions/web\.lance"):
        table.open()

    first = upsert(table, rows(["a", "b"]), SCHEMA, ["id"])
    second = upsert(table, rows(["b", "c"], v=1), SCHEMA, ["id"])  # b replaced, c added
    assert table.exists() and table.latest_version() == second > first
    append_rows(table, rows(["d"]), SCHEMA)

    latest = table.to_table().to_pydict()
    assert (sorted(zip(latest["id"], latest["v"], strict=True))
            == [("a", 0), ("b", 1), ("c", 1), ("d", 0)])
    assert sorted(table.at(first).to_table()["id"].to_pylist()) == ["a", "b"]
    assert any(k.endswith(".manifest") for k in keys_under(s3_server, table.uri))


def test_ray_write_checks_and_stats_on_s3_leave_nothing_on_local_disk(
        ray_session, s3_server, s3_root, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a path mistaken for a local one would appear here
    storage = Storage.from_env()
    uri = storage.table(RAW_IMAGES, "web")
    ids = [f"web:{i}" for i in range(40)]
    data = ray.data.from_items([{"id": i, "v": n} for n, i in enumerate(ids)],
                               override_num_blocks=4)
    policy = FragmentPolicy(target_bytes=1 << 20)
    report = write_dataset_atomically(data, uri, policy, SCHEMA)
    assert report.rows == 40 and report.bytes > 0 and report.version >= 1
    assert duplicate_ids(uri) == (0, [])
    assert fragment_health(uri, policy).healthy
    assert profile_table(uri).rows == 40
    again = write_dataset_atomically(data.limit(10), uri, policy, SCHEMA)  # a rerun replaces
    assert again.version > report.version and uri.count_rows() == 10
    assert uri.at(report.version).count_rows() == 40
    assert list(tmp_path.iterdir()) == []


def test_explicit_settings_override_the_environment_in_ray_tasks_too(
        ray_session, s3_server, s3_root, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(ObjectStoreError, match="credentials refused"):
        Storage.from_env().table(RAW_IMAGES, "web").latest_version()
    storage = Storage(s3_root, {"aws_secret_access_key": s3_server.secret_key})
    table = storage.table(RAW_IMAGES, "web")
    data = ray.data.from_items([{"id": "a", "v": 1}, {"id": "b", "v": 2}])
    write_dataset_atomically(data, table, FragmentPolicy(), SCHEMA)
    assert table.count_rows() == 2
    assert duplicate_ids(table) == (0, [])


def test_two_concurrent_upserts_both_land(s3_server, s3_root):
    """Racing writers: one commits first, the other's conditional put of the same version
    fails and Lance retries it on top; every row of both is there, shared keys once."""
    uri = Storage.from_env().table(CAPTIONS, "web")
    upsert(uri, rows(["shared"]), SCHEMA, ["id"])
    start, errors = threading.Barrier(2), []

    def writer(name: str, value: int) -> None:
        start.wait()
        try:
            for chunk in range(3):
                upsert(uri, rows([f"{name}{chunk}", "shared"], v=value), SCHEMA, ["id"])
        except Exception as exc:  # collected: a thread's exception would be lost
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(n, v)) for n, v in (("x", 1), ("y", 2))]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert errors == []
    table = uri.to_table().to_pydict()
    assert sorted(table["id"]) == ["shared", "x0", "x1", "x2", "y0", "y1", "y2"]
    assert uri.latest_version() == 7


# Bad input: each fails at once with the URI and the cause.

def dead_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.fixture()
def silent_endpoint():
    """An endpoint that accepts connections and never answers (a black-holed load balancer)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    yield f"http://127.0.0.1:{s.getsockname()[1]}"
    s.close()


@pytest.mark.timeout(60)  # a hang guard only: each case is one request, no retries
@pytest.mark.parametrize("case", ["missing bucket", "wrong secret", "unknown key", "refused"])
def test_bad_input_fails_at_once_naming_the_uri_and_cause(s3_server, s3_root, case):
    root, options = s3_root, {}
    if case == "missing bucket":
        root = "s3://no-such-bucket-here/corpus"
    elif case == "wrong secret":
        options = {"aws_secret_access_key": "wrong"}
    elif case == "unknown key":
        options = {"aws_access_key_id": "nobody"}
    else:
        options = {"aws_endpoint": f"http://127.0.0.1:{dead_port()}"}
    cause = {"missing bucket": "bucket 'no-such-bucket-here' does not exist",
             "wrong secret": "credentials refused", "unknown key": "credentials refused",
             "refused": "is unreachable"}[case]
    storage = Storage(root, options)
    table = storage.table(RAW_IMAGES, "web")
    for attempt in (table.latest_version, table.open, table.exists,
                    lambda: TableRef.of(table.uri, overrides=options).exists(),
                    lambda: upsert(table, rows(["a"]), SCHEMA, ["id"])):
        with pytest.raises(ObjectStoreError) as failure:
            attempt()
        assert root in str(failure.value) and cause in str(failure.value)


def test_an_endpoint_that_never_answers_fails_within_the_preflight_timeout(
        s3_server, s3_root, silent_endpoint, monkeypatch):
    monkeypatch.setattr(object_store, "PREFLIGHT_READ_TIMEOUT_S", 0.5)
    with pytest.raises(ObjectStoreError, match=f"endpoint {silent_endpoint} is unreachable"):
        prepare_output_dir(TableRef.of(f"{s3_root}/lance/t.lance",
                                       overrides={"aws_endpoint": silent_endpoint}),
                           "Lance table")


# The IO manager: a whole asset with its checks, every byte of its table in the bucket.

def test_raw_images_materialise_into_the_bucket_with_checks(
        ray_session, s3_server, s3_root, small_folder, tmp_path):
    import dagster as dg

    from prx_assets.definitions import build_defs

    sources = write_sources(tmp_path / "sources.yaml",
                            [f"{{name: web, kind: image_folder, uri: {small_folder}}}"])
    job = build_defs(sources).resolve_job_def("source_job")
    result = job.execute_in_process(partition_key="web", instance=dg.DagsterInstance.ephemeral(),
                                    asset_selection=[dg.AssetKey("raw_images")])
    assert result.success
    [event] = result.get_asset_materialization_events()
    meta = {k: v.value for k, v in event.event_specific_data.materialization.metadata.items()}
    uri = f"{s3_root}/lance/raw_images/web.lance"
    assert meta["path"] == uri and meta["dagster/row_count"] == 8 and meta["ok_rows"] == 3
    checks = {e.event_specific_data.check_name: e.event_specific_data.passed
              for e in result.all_events if e.event_type_value == "ASSET_CHECK_EVALUATION"}
    assert checks["ids_unique"] and checks["fragments_healthy"]
    assert Storage(s3_root).table(RAW_IMAGES, "web").at(meta["lance_version"]).count_rows() == 8
    assert any("/data/" in k for k in keys_under(s3_server, uri))
    assert not (tmp_path / "data").exists()


def test_the_partition_fails_naming_the_uri_when_the_bucket_is_missing(
        ray_session, s3_server, s3_root, small_folder, tmp_path):
    import dagster as dg

    from prx_assets.defs.io_managers import RayLanceIOManager
    from prx_assets.defs.resources import StorageResource

    @dg.asset(name="corpus", io_manager_key="lance_io_manager")
    def tiny(context) -> ray.data.Dataset:
        return ray.data.from_items([{"id": "a", "v": 1}])

    storage = StorageResource(root="s3://no-such-bucket-here/corpus")
    result = dg.materialize([tiny], raise_on_error=False, resources={
        "lance_io_manager": RayLanceIOManager(storage=storage)})
    assert not result.success
    [failure] = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    message = str(failure.event_specific_data.error)
    assert "s3://no-such-bucket-here/corpus" in message and "does not exist" in message


def test_two_writers_creating_the_same_table_both_land(s3_server, s3_root):
    """The first commit of a table races too: the writer that loses the create merges into
    the table the winner made."""
    uri = Storage.from_env().table(CAPTIONS, "fresh")
    start, errors = threading.Barrier(2), []

    def writer(name: str) -> None:
        start.wait()
        try:
            upsert(uri, rows([name, "shared"]), SCHEMA, ["id"])
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(n,)) for n in ("x", "y")]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert errors == []
    ids = uri.to_table()["id"].to_pylist()
    assert sorted(ids) == ["shared", "x", "y"]


@pytest.mark.parametrize("where", [pytest.param("s3", marks=pytest.mark.s3), "local"])
def test_a_create_that_finds_the_table_created_meanwhile_merges_into_it(
        where, request, tmp_path, monkeypatch):
    """The create race made deterministic: the other writer's whole upsert lands after this
    writer found no table and wrote its files, before it commits. A create committed as a
    plain Overwrite would replace the other's rows; this one must merge."""
    from prx_assets.storage import lance_tables

    root = request.getfixturevalue("s3_root") if where == "s3" else str(tmp_path)
    uri = Storage(root).table(CAPTIONS, "web")
    real_write = lance_tables.write_fragments

    def write_then_lose_the_race(*args, **kwargs):
        fragments = real_write(*args, **kwargs)
        monkeypatch.setattr(lance_tables, "write_fragments", real_write)
        upsert(uri, rows(["first", "shared"], v=1), SCHEMA, ["id"])  # the other writer
        return fragments

    monkeypatch.setattr(lance_tables, "write_fragments", write_then_lose_the_race)
    upsert(uri, rows(["second", "shared"], v=2), SCHEMA, ["id"])
    table = uri.to_table().to_pydict()
    assert (sorted(zip(table["id"], table["v"], strict=True))
            == [("first", 1), ("second", 2), ("shared", 2)])


def test_the_io_manager_hands_downstream_a_pinned_read_from_the_bucket(
        ray_session, s3_server, s3_root):
    """Downstream reads run in Ray tasks, whose environment has no AWS variables (the
    cluster started before this test set them): they work only on the options the IO
    manager resolved and passed."""
    import dagster as dg

    from prx_assets.defs.io_managers import RayLanceIOManager
    from prx_assets.defs.resources import StorageResource

    @dg.asset(name="duplicates", io_manager_key="lance_io_manager")
    def upstream() -> ray.data.Dataset:
        return ray.data.from_items([{"id": f"d{i}", "v": i} for i in range(5)])

    @dg.asset(name="corpus", io_manager_key="lance_io_manager",
              ins={"duplicates": dg.AssetIn("duplicates")})
    def downstream(duplicates: ray.data.Dataset) -> ray.data.Dataset:
        return duplicates.filter(lambda row: row["v"] % 2 == 0)

    io_manager = RayLanceIOManager(storage=StorageResource(root=s3_root))
    result = dg.materialize([upstream, downstream], resources={"lance_io_manager": io_manager})
    assert result.success
    corpus = Storage(s3_root).table("corpus").to_table()
    assert sorted(corpus["id"].to_pylist()) == ["d0", "d2", "d4"]
