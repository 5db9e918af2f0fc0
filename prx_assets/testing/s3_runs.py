"""Helpers for the object-storage e2e tests: a small webdataset source, the whole graph run
in a driver process with a user's environment, and listings of the bucket."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

from prx_assets.storage import object_store
from prx_assets.storage.tables import (
    BUCKETED_IMAGES,
    CAPTION_LABELS,
    CAPTIONS,
    CORPUS,
    DUPLICATES,
    MDS_SAMPLES,
    OPT_OUTS,
    PHASHES,
    RAW_IMAGES,
)
from prx_assets.testing.images import jpeg_bytes

SOURCE = "tars"
SIZES = [(480, 360), (360, 480), (640, 400), (512, 512), (600, 600), (400, 700)]
PER_SOURCE_TABLES = (RAW_IMAGES, BUCKETED_IMAGES, PHASHES, CAPTIONS, CAPTION_LABELS,
                     MDS_SAMPLES)
GLOBAL_TABLES = (DUPLICATES, OPT_OUTS, CORPUS)
# Assets the graph runs skip on object storage: none (every asset, MDS shards and skip
# lists included, writes to the bucket). Kept as a knob for a back end that lacks one.
NOT_YET_ON_OBJECT_STORAGE: tuple[str, ...] = ()


def write_webdataset(folder: Path, items: int = 12, tars: int = 1) -> Path:
    """`items` jpg+txt pairs, plus two exact copies under other keys (dedup), dealt over
    `tars` tars `shard-NNN.tar` (ingest reads one tar per task: several tars spread it)."""
    folder.mkdir(parents=True)
    members: list[list[tuple[str, bytes]]] = [[] for _ in range(tars)]
    for i in range(items):
        width, height = SIZES[i % len(SIZES)]
        image = jpeg_bytes(width, height, i)
        members[i % tars] += [(f"{i:03d}.jpg", image),
                              (f"{i:03d}.txt", f"Soft coloured shapes, picture {i}.".encode())]
        if i in (0, 5):
            members[i % tars] += [(f"copy{i:03d}.jpg", image), (f"copy{i:03d}.txt", b"A copy.")]
    for t, tar_members in enumerate(members):
        with tarfile.open(folder / f"shard-{t:03d}.tar", "w") as tar:
            for name, data in tar_members:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return folder


def upload_source(server, folder: Path, uri: str) -> str:
    """Put every file of a local source folder under `uri` in the bucket; returns `uri`."""
    _, bucket, prefix = object_store.split_uri(uri)
    client = server.client()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(folder).as_posix()}")
    return uri


def keys_under(server, root: str) -> list[str]:
    _, bucket, prefix = object_store.split_uri(root)
    pages = server.client().get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Prefix=prefix + "/")
    return [item["Key"][len(prefix) + 1:] for page in pages for item in page.get("Contents", [])]


def put_opt_out(server, root: str, sample_id: str) -> None:
    _, bucket, prefix = object_store.split_uri(root)
    body = json.dumps({"key_type": "id", "value": sample_id, "reference": "e2e",
                       "timestamp": "2026-01-01T00:00:00Z"}) + "\n"
    server.client().put_object(Bucket=bucket, Key=f"{prefix}/opt_outs/request-1.jsonl",
                               Body=body.encode())


# The run a user makes: `PRX_DATA_ROOT=s3://... AWS_...=...` in the environment of a fresh
# process (its embedded Ray's workers inherit the variables, as nodes set up with them do).
DRIVER = """
import json, sys
from pathlib import Path
import dagster as dg
from prx_assets.definitions import build_defs
from prx_assets.engine import ray_runtime

sources, source, not_yet = Path(sys.argv[1]), sys.argv[2], set(sys.argv[3].split(","))
defs, instance = build_defs(sources), dg.DagsterInstance.ephemeral()
ray_runtime.connect(num_cpus=2)  # or the cluster RAY_ADDRESS names
per_source = [key for key in defs.resolve_job_def("source_job").asset_layer
              .executable_asset_keys if key.path[-1] not in not_yet]
report = {}
# The order `make demo` uses: the source, then dedup and the opt-out audit across sources,
# then the source's skip lists (they need the duplicates table), then the corpus table.
for job, partition, selection in (("source_job", source, per_source), ("dedup_job", None, None),
                                  ("skip_lists_job", source, None),
                                  ("corpus_table_job", None, None)):
    result = defs.resolve_job_def(job).execute_in_process(
        partition_key=partition, instance=instance, asset_selection=selection,
        raise_on_error=False)
    report[job] = {
        "success": result.success,
        "failures": [e.event_specific_data.error.message[-2000:] for e in result.all_events
                     if e.event_type_value == "STEP_FAILURE"],
        "materialized": sorted(e.event_specific_data.materialization.asset_key.path[-1]
                               for e in result.get_asset_materialization_events()),
        "ray_nodes": {e.event_specific_data.materialization.asset_key.path[-1]:
                      e.event_specific_data.materialization.metadata["ray_nodes"].value
                      for e in result.get_asset_materialization_events()
                      if "ray_nodes" in e.event_specific_data.materialization.metadata},
        "failed_checks": {
            e.event_specific_data.asset_key.path[-1] + ":" + e.event_specific_data.check_name:
            e.event_specific_data.severity.value for e in result.all_events
            if e.event_type_value == "ASSET_CHECK_EVALUATION" and not e.event_specific_data.passed},
    }
print("RESULT" + json.dumps(report))
"""


def run_graph(sources: Path, env: dict, workdir: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", DRIVER, str(sources), SOURCE,
                          ",".join(NOT_YET_ON_OBJECT_STORAGE)],
                         env=env, cwd=workdir, capture_output=True, text=True, timeout=1500)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT")]
    assert lines, out.stdout[-3000:] + out.stderr[-5000:]
    return json.loads(lines[-1][len("RESULT"):])


def assert_mds_in_bucket(keys: list[str], source: str = SOURCE) -> str:
    """The source's MDS tree is in the bucket as the design lays it out: shards and an
    index.json per leaf under `mds/.trees/<source>/<version>/`, the pointer object
    `mds/<source>.current.json` naming that version, skip-list sidecars beside the shards.
    Returns the current version."""
    assert f"mds/{source}.current.json" in keys, sorted(k for k in keys if k.startswith("mds/"))
    tree = [k.split("/", 3) for k in keys if k.startswith(f"mds/.trees/{source}/")]
    versions = {parts[2] for parts in tree}
    assert versions, "no MDS tree version in the bucket"
    leaves = {k.rsplit("/", 1)[0] for *_, k in tree if k.endswith("/index.json")}
    assert leaves, f"no leaf index.json under mds/.trees/{source}/"
    shards = [k for *_, k in tree if k.endswith(".mds")]
    assert shards and all(s.rsplit("/", 1)[0] in leaves for s in shards), shards
    assert any(k.endswith(".skip.json") for *_, k in tree), "no skip-list sidecar"
    return max(versions)
