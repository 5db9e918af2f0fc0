"""The whole graph for one webdataset source with PRX_DATA_ROOT in a bucket of the real S3
test server: every table it writes is in the bucket, nothing is left on local disk, the
checks pass, and the opt-out folder in the bucket drives the audit and the sensor."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import dagster as dg
import pytest

from prx_assets.storage.layout import Storage
from prx_assets.storage.tables import (
    BUCKETED_IMAGES,
    CAPTION_LABELS,
    CAPTIONS,
    CORPUS,
    DUPLICATES,
    MDS_SAMPLES,
    MDS_SHARDS,
    OPT_OUTS,
    PHASHES,
    RAW_IMAGES,
    SKIP_LISTS,
)
from prx_assets.testing.s3_runs import (
    GLOBAL_TABLES,
    PER_SOURCE_TABLES,
    SOURCE,
    assert_mds_in_bucket,
    keys_under,
    put_opt_out,
    run_graph,
    upload_source,
    write_webdataset,
)
from prx_assets.testing.s3_server import S3Server
from prx_assets.testing.sources import write_sources

pytestmark = pytest.mark.e2e  # whole-graph runs and runs in subprocesses


@pytest.mark.timeout(1800)
def test_the_whole_graph_of_a_webdataset_source_lives_in_the_bucket(
        s3_server, s3_root, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from prx_assets.definitions import build_defs
    from prx_assets.defs.opt_outs import build_opt_out_sensor
    from prx_assets.defs.resources import StorageResource
    from prx_assets.stages.ingest.ids import sample_id
    from prx_assets.stages.report.funnel import source_funnel

    # The source is a tar in the bucket too, streamed from there (never downloaded whole).
    tars = write_webdataset(tmp_path / "wds")
    source_uri = upload_source(s3_server, tars, f"{s3_root}-sources")
    shutil.rmtree(tars)  # nothing of the source stays on local disk
    sources = write_sources(tmp_path / "sources.yaml",
                            [f"{{name: {SOURCE}, kind: webdataset, uri: {source_uri}}}"])
    opted_out = sample_id(SOURCE, "shard-000.tar/003")
    put_opt_out(s3_server, s3_root, opted_out)
    # A relative or mistaken local path would land in one of these two folders.
    workdir, scratch = tmp_path / "cwd", tmp_path / "tmp"
    workdir.mkdir()
    scratch.mkdir()
    ray_tmp = tempfile.mkdtemp(prefix="prxray-", dir="/tmp")
    env = {**os.environ, **s3_server.env(), "PRX_DATA_ROOT": s3_root, "TMPDIR": str(scratch),
           "RAY_TMPDIR": ray_tmp,  # short socket paths
           "DAGSTER_HOME": str(tmp_path / "dagster"), "RAY_USAGE_STATS_ENABLED": "0",
           "HF_HUB_OFFLINE": "1"}
    env.pop("RAY_ADDRESS", None)
    (tmp_path / "dagster").mkdir()

    try:
        report = run_graph(sources, env, workdir)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    for job, outcome in report.items():
        assert outcome["success"], (job, outcome["failures"])
        # WARN checks may fail on a corpus this small (label shares of a dozen pictures).
        assert set(outcome["failed_checks"].values()) <= {"WARN"}, (job, outcome)
    assert set(PER_SOURCE_TABLES) - {MDS_SAMPLES} | {MDS_SHARDS} <= set(
        report["source_job"]["materialized"])
    assert report["skip_lists_job"]["materialized"] == [SKIP_LISTS]

    keys = keys_under(s3_server, s3_root)
    for table in PER_SOURCE_TABLES:
        versions = [k for k in keys if k.startswith(f"lance/{table}/{SOURCE}.lance/_versions/")]
        assert versions, f"no {table} table in the bucket; keys: {sorted(keys)[:20]}"
    for table in GLOBAL_TABLES:
        assert any(k.startswith(f"lance/{table}.lance/_versions/") for k in keys), table
    assert any(k.startswith(f"lance/{RAW_IMAGES}/{SOURCE}.lance/data/") for k in keys)
    assert_mds_in_bucket(keys)
    # Nothing on local disk: no ./data or other output in the working folder, and nothing
    # left in TMPDIR (the MDS parts' temporary folders, a shard each, are gone).
    assert list(workdir.iterdir()) == []
    assert [p for p in scratch.rglob("*") if p.is_file()] == []

    store = Storage(s3_root)
    assert store.table(RAW_IMAGES, SOURCE).count_rows() == 14
    assert store.table(CAPTIONS, SOURCE).count_rows() == 14
    assert store.table(CAPTION_LABELS, SOURCE).count_rows() == 14
    assert store.table(DUPLICATES).count_rows() == 4  # two groups of two
    audit = store.table(OPT_OUTS).to_table(columns=["id", "via"]).to_pylist()
    assert {"id": opted_out, "via": "direct"} in audit
    assert store.table(CORPUS).count_rows() == 14
    assert store.table(MDS_SAMPLES, SOURCE).count_rows() == 14
    resources = build_defs(sources).resources
    funnel = source_funnel(store, SOURCE, resources["captioner"].caption_version(),
                           resources["classifier"].classifier_version())
    assert (funnel.raw, funnel.kept, funnel.in_shards, funnel.duplicates) == (14, 14, 14, 2)
    assert 3 <= funnel.skipped < 14  # the copies and the opt-out, maybe label skips, read
    # from the sidecars in the bucket

    _read_back_from_the_bucket(store, opted_out, tmp_path, monkeypatch, s3_server)

    # The opt-out sensor reads the same folder in the bucket: one new file, one run for
    # the audit and one skip-lists run for the source it hits.
    sensor = build_opt_out_sensor(str(sources))
    instance = dg.DagsterInstance.ephemeral()
    with dg.build_sensor_context(instance=instance,
                                 resources={"storage": StorageResource()}) as context:
        result = sensor(context)
    assert sorted(r.asset_selection[0].path[-1] + ":" + str(r.partition_key)
                  for r in result.run_requests) == [f"{OPT_OUTS}:None", f"skip_lists:{SOURCE}"]
    with dg.build_sensor_context(instance=instance, cursor=result.cursor,
                                 resources={"storage": StorageResource()}) as context:
        again = sensor(context)
    # Nothing new, but its runs were not created (no daemon here): the batch is not applied
    # yet, so they are asked for again under the same keys.
    assert ({r.run_key for r in again.run_requests}
            == {r.run_key for r in result.run_requests})


def _cli(*argv: str) -> str:
    import contextlib
    import io

    from prx_assets import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(list(argv)) == 0, argv
    return out.getvalue()


def _read_back_from_the_bucket(store: Storage, opted_out: str, tmp_path: Path,
                               monkeypatch: pytest.MonkeyPatch, s3_server: S3Server) -> None:
    """What a user does with the outputs, PRX_DATA_ROOT in the bucket: `mds-uri`, a plain
    StreamingDataset over one leaf, the project loader (skip lists applied), search and
    similar; every shard read lands in the given cache folders only."""
    import gc

    from prx_assets.loader import build_dataset
    from prx_assets.stages.skip_lists.skip_lists import duplicate_ids
    from prx_assets.storage.sidecars import REASON_DEDUP, REASON_OPTOUT
    from prx_assets.testing.shared_memory import plain_dataset, release_shared_memory

    uri = _cli("mds-uri", SOURCE).strip()
    assert uri.startswith(f"{store.root}/mds/.trees/{SOURCE}/"), uri
    samples = store.table(MDS_SAMPLES, SOURCE).to_table(columns=["id", "tier", "leaf"]).to_pylist()
    leaf = sorted({s["leaf"] for s in samples})[0]  # e.g. 512/512x512
    monkeypatch.delenv("S3_ENDPOINT_URL", raising=False)
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)  # a trainer's own standard variables for boto3
    monkeypatch.setenv("AWS_DEFAULT_REGION", s3_server.region)
    release_shared_memory(tmp_path)
    dataset = plain_dataset(remote=f"{uri}/{leaf}", local=str(tmp_path / "cache-plain"),
                               batch_size=1, shuffle=False)
    streamed = sorted(dataset[i]["id"] for i in range(dataset.num_samples))
    del dataset
    gc.collect()
    release_shared_memory(tmp_path)
    assert streamed == sorted(s["id"] for s in samples if s["leaf"] == leaf)

    # The loader streams every leaf of a tier and drops what the sidecars skip: here the
    # duplicate copies and the opted-out id (computed from the tables, not the sidecars).
    tier = int(leaf.split("/")[0])
    dropped = duplicate_ids(store.table(DUPLICATES), SOURCE) | {opted_out}
    assert len(dropped) == 3
    loaded = sorted(s["id"] for s in build_dataset(
        store.mds_root, tier, 1, weights={SOURCE: 1.0}, skip_reasons=(REASON_DEDUP, REASON_OPTOUT),
        shuffle=False, cache_dir=tmp_path / "cache-loader"))
    gc.collect()
    release_shared_memory(tmp_path)
    assert loaded == sorted(s["id"] for s in samples
                            if s["tier"] == tier and s["id"] not in dropped)

    # search and similar on the corpus table in the bucket.
    row = store.table(CORPUS).to_table(columns=["id", "caption"], limit=1).to_pylist()[0]
    word = max(row["caption"].split(), key=len).strip(".,;:")
    found = _cli("search", word, "--k", "14")
    assert row["id"] in found, (word, found)
    near = _cli("similar", row["id"], "--k", "3")
    assert near.strip() and "no matches" not in near and row["id"] not in near, near


def refused_endpoint() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # closed again: connections refused


@pytest.mark.timeout(300)  # a hang guard only: each case is one preflight request
@pytest.mark.parametrize("case", ["missing bucket", "wrong credentials", "unreachable endpoint"])
def test_a_bad_data_root_fails_the_partition_at_once_naming_the_uri_and_cause(
        ray_session, s3_server, s3_root, small_folder, tmp_path: Path, monkeypatch, case):
    """The partition's first asset fails in one step (no retries), with the data root's URI
    and the cause in the error, and nothing is written anywhere."""
    from prx_assets.definitions import build_defs

    root, cause = s3_root, {"missing bucket": "bucket 'no-such-bucket-here' does not exist",
                            "wrong credentials": "credentials refused",
                            "unreachable endpoint": "is unreachable"}[case]
    if case == "missing bucket":
        root = "s3://no-such-bucket-here/corpus"
    elif case == "wrong credentials":
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    else:
        monkeypatch.setenv("AWS_ENDPOINT_URL", refused_endpoint())
    monkeypatch.setenv("PRX_DATA_ROOT", root)
    monkeypatch.chdir(tmp_path)
    sources = write_sources(tmp_path / "sources.yaml",
                            [f"{{name: web, kind: image_folder, uri: {small_folder}}}"])
    result = build_defs(sources).resolve_job_def("source_job").execute_in_process(
        partition_key="web", instance=dg.DagsterInstance.ephemeral(), raise_on_error=False)
    assert not result.success
    failures = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    assert len(failures) == 1 and not [e for e in result.all_events
                                       if e.event_type_value == "STEP_RESTARTED"]
    message = str(failures[0].event_specific_data.error)
    assert root in message and cause in message, message
    assert result.get_asset_materialization_events() == []
    assert not (tmp_path / "data").exists()


@pytest.mark.timeout(900)
def test_captions_labels_dedup_and_opt_outs_carry_their_settings_into_ray_tasks(
        ray_session, s3_server, s3_root, monkeypatch):
    """Here the Ray workers started before the test set the AWS variables, and the
    environment holds a wrong secret: these stages work only on the settings the Storage
    resolved into its table handles, carried into every Lance call and Ray read (the right
    secret, an override)."""
    import pyarrow as pa
    import ray.data

    from prx_assets.stages.captions.captioners import CaptionerSpec
    from prx_assets.stages.captions.captions import active_caption_filter
    from prx_assets.stages.captions.runs import (
        caption_source,
        captions_coverage,
        done_rows,
        pending_requests,
    )
    from prx_assets.stages.dedup.dedup import (
        DUPLICATES_SCHEMA,
        duplicates_dataset,
        hash_inputs,
        summarise,
    )
    from prx_assets.stages.labels.runs import LabelerSpec, label_coverage, label_source
    from prx_assets.stages.opt_outs.resolution import resolve_opt_outs
    from prx_assets.storage.lance_tables import FragmentPolicy, write_dataset_atomically

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    options = {"aws_secret_access_key": s3_server.secret_key}
    store = Storage(s3_root, options)
    ids = [f"web:{i:02d}" for i in range(6)]
    inputs = {
        RAW_IMAGES: pa.table({"id": ids, "sha256": [f"{i:064x}" for i in range(6)],
                              "source_key": [f"k{i}" for i in range(6)],
                              "original_caption": [f"A red square, number {i}." for i in
                                                   range(6)]}),
        BUCKETED_IMAGES: pa.table({"id": ids, "status": ["ok"] * 6}),
        PHASHES: pa.table({"id": ids, "phash": pa.array([7, 7, 1, 2, 3, 4], pa.int64()),
                           "pixels": pa.array([10, 20, 1, 1, 1, 1], pa.int64()),
                           "flat": [False] * 6}),
    }
    for name, table in inputs.items():
        write_dataset_atomically(ray.data.from_arrow(table), store.table(name, "web"),
                                 FragmentPolicy(), table.schema)

    spec = CaptionerSpec()
    captions = store.table(CAPTIONS, "web")
    requests = pending_requests(store.table(BUCKETED_IMAGES, "web").read(),
                                store.table(RAW_IMAGES, "web").read(), captions, spec)
    assert caption_source(requests, captions, spec, chunk_rows=4).written == 6
    cover = captions_coverage(store.table(BUCKETED_IMAGES, "web"), captions, spec.version())
    assert (cover.inputs, done_rows(cover)) == (6, 6)
    again = pending_requests(store.table(BUCKETED_IMAGES, "web").read(), None, captions,
                             CaptionerSpec())
    assert again.count() == 0  # done ids read from the bucket

    labels, caption_filter = store.table(CAPTION_LABELS, "web"), active_caption_filter(
        spec.version())
    report = label_source(captions, labels, spec.version(), caption_filter,
                          LabelerSpec(), chunk_rows=4)
    assert report.written == 6
    assert label_coverage(captions, labels, caption_filter, spec.version(),
                          report.classifier_version).rows() == 6

    hashes, missing = hash_inputs(store, ["web"])
    assert missing == []
    duplicates = store.table(DUPLICATES)
    write_dataset_atomically(duplicates_dataset(hashes), duplicates, FragmentPolicy(),
                             DUPLICATES_SCHEMA)
    summary = summarise(duplicates, {"web": 6})
    assert summary.groups == 1 and summary.removed_per_source == {"web": 1}

    put_opt_out(s3_server, s3_root, "web:00")
    resolution = resolve_opt_outs(store, ["web"])
    assert resolution.requests == 1 and resolution.errors == []
    audit = resolution.audit.to_pylist()
    assert sorted((r["id"], r["via"]) for r in audit) == [("web:00", "direct"),
                                                         ("web:01", "duplicate")]
