"""MDS trees on object storage (the SeaweedFS test server): versioned prefixes, a pointer
object written last, `prx-assets mds-uri`, plain StreamingDataset and the loader streaming
from the remote, an incremental append and a skip-lists version on S3."""

import contextlib
import dataclasses
import gc
import io
import json

from prx_assets import cli
from prx_assets.loader import build_dataset
from prx_assets.stages.shards import mds, plan, verify
from prx_assets.stages.skip_lists.skip_lists import (
    build_skip_lists,
    mapping_batches,
    mapping_shards,
    publish_skip_lists,
)
from prx_assets.storage.lance_tables import overwrite_rows
from prx_assets.storage.layout import Storage
from prx_assets.storage.refs import Location
from prx_assets.storage.sidecars import REASON_STALE, read_sidecar
from prx_assets.storage.trees import tree_store
from prx_assets.testing.mds_corpus import WRITE_OPTIONS as OPTIONS
from prx_assets.testing.mds_corpus import build_corpus, inputs_for
from prx_assets.testing.shared_memory import plain_dataset, release_shared_memory


def _upload_tables(local_root, storage: Storage) -> None:
    """The fixture's input tables, written into the bucket."""
    for name in ("bucketed_images", "captions"):
        table = Storage(local_root).table(name, "web").to_table()
        overwrite_rows(storage.table(name, "web"), table, table.schema)


def _inputs(storage: Storage):
    return plan.SampleInputs(bucketed=storage.table("bucketed_images", "web"),
                             captions=storage.table("captions", "web"),
                             caption_filter=inputs_for(storage.root, "web").caption_filter)


def _mds_uri() -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["mds-uri", "web"]) == 0
    return out.getvalue().strip()


def _stream_count(remote: str, cache) -> tuple[int, list[str]]:
    dataset = plain_dataset(remote=remote, local=str(cache), batch_size=1, shuffle=False)
    ids = [dataset[i]["id"] for i in range(dataset.num_samples)]
    del dataset
    gc.collect()
    release_shared_memory(cache)
    return len(ids), ids


def _loader_ids(storage: Storage, tmp_path, **options) -> list[str]:
    """The ids the loader yields from the remote tree; its reader leases released after
    (their renewing thread would outlive the test and the S3 server)."""
    dataset = build_dataset(storage.mds_root, 1, 1, weights={"web": 1.0}, shuffle=False,
                            cache_dir=tmp_path / "loader-cache", **options)
    try:
        return [s["id"] for s in dataset]
    finally:
        if dataset.reader_leases is not None:
            dataset.reader_leases.release()


def test_tree_on_s3_streams_appends_and_versions_its_skip_lists(ray_session, s3_root, tmp_path,
                                                               monkeypatch):
    storage = Storage(s3_root)
    local = tmp_path / "local"
    corpus = build_corpus(local, "web", per_shape=5)
    _upload_tables(local, storage)
    # The first build in Ray tasks (the parts upload from the workers; their environment was
    # fixed before this test set the AWS variables, so the settings travel with the inputs).
    first = mds.write_mds_tree(_inputs(storage), storage, "web",
                               dataclasses.replace(OPTIONS, parallel=True))
    assert isinstance(first.path, str) and first.path.startswith(s3_root + "/mds/.trees/web/")
    assert first.samples == len(corpus["images"])
    store = tree_store(storage, "web")
    pointer = json.loads(store.link.read_text())
    assert pointer["version"] == first.tree_version
    assert not (tmp_path / "data").exists()  # nothing of the tree on local disk

    # mds-uri prints the prefix a plain StreamingDataset streams a leaf from, with the
    # standard variables alone (streaming's own S3_ENDPOINT_URL is not in the environment:
    # its boto3 client reads AWS_ENDPOINT_URL itself).
    monkeypatch.delenv("S3_ENDPOINT_URL", raising=False)
    uri = _mds_uri()
    assert uri == first.path
    count, ids = _stream_count(f"{uri}/1/64x64", tmp_path / "cache-1")
    assert count == sum(i.startswith("web:1-64x64") for i in corpus["images"])
    assert ids == sorted(ids)
    checks, problems = verify.verify_tree(storage, "web")
    assert all(c.ok for c in checks) and not problems, (checks, problems)

    # Append: one sample removed (stale), none added; the new version holds server-side
    # copies of every old shard and a sidecar with the stale index.
    gone = sorted(i for i in corpus["images"] if i.startswith("web:1-64x64"))[0]
    storage.table("bucketed_images", "web").open().delete(f"id = '{gone}'")
    second = mds.write_mds_tree(_inputs(storage), storage, "web", OPTIONS)
    assert second.appended and (second.processed, second.removed) == (0, 1)
    assert _mds_uri() == second.path != first.path
    sidecars = Location.of(f"{second.path}/1/64x64").files(".skip.json")
    assert [read_sidecar(p)[REASON_STALE] for p in sidecars] == [[0]]
    count, _ = _stream_count(f"{second.path}/1/64x64", tmp_path / "cache-2")
    assert count == sum(i.startswith("web:1-64x64") for i in corpus["images"])  # still stored
    checks, problems = verify.verify_tree(storage, "web")
    assert all(c.ok for c in checks) and not problems, (checks, problems)

    # The loader streams the remote tree into its cache and skips the stale sample.
    loader_ids = _loader_ids(storage, tmp_path, skip_reasons=())
    expected = {i for i in corpus["images"] if i.startswith("web:1-")} - {gone}
    assert sorted(loader_ids) == sorted(expected)

    # A skip-lists update is a new version with a new sidecar set, the pointer moved last;
    # the version a reader resolved before still reads whole, with its own sidecars.
    dedup = sorted(expected)[:2]
    mapping_table = storage.table("mds_samples", "web")
    shards, _ = mapping_shards(mapping_table)
    report = publish_skip_lists(storage, "web", build_skip_lists(
        mapping_batches(mapping_table), {"dedup": set(dedup)}), shards)
    assert report.skipped_per_reason == {"dedup": 2, REASON_STALE: 1}
    third = _mds_uri()
    assert third not in (second.path, first.path)
    held = second.path  # what a trainer resolved before the update
    assert [read_sidecar(p) for p in Location.of(f"{held}/1/64x64").files(".skip.json")
            ] == [{REASON_STALE: [0]}]
    count, _ = _stream_count(f"{held}/1/64x64", tmp_path / "cache-3")
    assert count == sum(i.startswith("web:1-64x64") for i in corpus["images"])
    loader_ids = _loader_ids(storage, tmp_path)
    assert sorted(loader_ids) == sorted(expected - set(dedup))
    # Within the retention window (7 days) every version stays in the bucket.
    assert tree_store(storage, "web").versions() == sorted(
        [first.tree_version, second.tree_version, third.rsplit("/", 1)[1]])
