"""The cluster path: the whole graph for one source through a real two-node Ray cluster,
compared with the same graph on the embedded Ray: the same tables, byte-identical shards."""

import json
import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import lance
import numpy as np
import pyarrow as pa
import pytest

from prx_assets.testing.images import jpeg_bytes
from prx_assets.testing.ray_cluster import TwoNodeCluster
from prx_assets.testing.sources import write_sources

pytestmark = pytest.mark.e2e  # whole-graph runs and runs in subprocesses

# One file per ingest task, so a small corpus still gives both nodes work.
RUN_CONFIG = {"ops": {"raw_images": {"config": {"files_per_task": 1}}}}
# The semantic steps in small pieces too: in Ray tasks (not in the driver, as a space this
# small otherwise is) over chunks and buckets of 4 rows.
SPACE_TASKS = {"in_process_rows": 0, "chunk_rows": 4, "bucket_rows": 4}
JOB_CONFIGS = {"semantic_job": {"ops": {"semantic_duplicates": {"config": SPACE_TASKS},
                                        "concepts": {"config": SPACE_TASKS}}},
               # The balanced sample is drawn over the rows in the embeddings' stored order,
               # which follows where their tasks wrote (SPACE_ORDERED): left out of the
               # sidecars, which are compared byte for byte.
               "skip_lists_job": {"ops": {"skip_lists": {"config": {"balance": False}}}}}
# Tables whose row numbers (the semantic space's order) or balanced sample follow the
# embeddings' stored order, not their content: the same ids are compared, not the rows.
SPACE_ORDERED = {"lance/concepts.lance", "lance/semantic_clusters.lance",
                 "lance/semantic_duplicates.lance"}
SIZES = [(480, 360), (360, 480), (640, 360), (512, 512), (900, 600), (400, 700)]
# Columns that record when or where a row was written, not what it holds.
# Times of writing, and what is derived from them: the MDS fingerprint mixes in the caption
# row's created_at (a re-captioned sample must count as changed without reading its text).
VOLATILE = {"created_at", "tree_version", "requested_at", "fingerprint"}
# Float vectors and scores: equal up to the order of float sums in differently sized batches.
APPROXIMATE = {"embedding", "score_visual", "score_text", "score_nsfw"}

DRIVER = """
import json, sys
from pathlib import Path
import dagster as dg
from prx_assets.demo.runner import materialize_all
runs = materialize_all(Path(sys.argv[1]), dg.DagsterInstance.ephemeral(), json.loads(sys.argv[2]),
                       semantic=True, job_run_configs=json.loads(sys.argv[3]))
nodes = {name: meta["ray_nodes"] for run in runs for name, meta in run.metadata.items()
         if "ray_nodes" in meta}
print("RESULT" + json.dumps({"success": [r.success for r in runs], "nodes": nodes}))
"""


# Sixteen pictures (every size a few times), each fourth copied under another key.
PICTURES, COPY_EVERY = 16, 4
FILES, COPIES = PICTURES + PICTURES // COPY_EVERY, PICTURES // COPY_EVERY


def write_corpus(images: Path) -> None:
    images.mkdir()
    for i in range(PICTURES):
        width, height = SIZES[i % len(SIZES)]
        data = jpeg_bytes(width, height, i)
        (images / f"{i:03d}.jpg").write_bytes(data)
        (images / f"{i:03d}.txt").write_text(f"A photo of soft coloured shapes, number {i}.")
        if i % COPY_EVERY == 0:  # exact copies under another key: duplicates, then skip lists
            (images / f"copy{i:03d}.jpg").write_bytes(data)
            (images / f"copy{i:03d}.txt").write_text(f"A copy of picture {i}.")


@pytest.fixture(scope="module")
def cluster(s3_server, tmp_path_factory):
    """One two-node cluster for the module's tests (starting one is most of a minute): each
    node with a work folder (TMPDIR) of its own and the AWS variables of the test server, as
    a deployment sets them on every node."""
    aws = s3_server.env()
    folders = {name: tmp_path_factory.mktemp(f"node-{name}") for name in ("head", "worker")}
    with TwoNodeCluster(node_envs=({**aws, "TMPDIR": str(folders["head"])},
                                   {**aws, "TMPDIR": str(folders["worker"])})) as started:
        yield started, folders


def run_on_cluster(cluster: TwoNodeCluster, sources: Path, data_root: Path) -> dict:
    env = {**cluster.driver_env(), "PRX_DATA_ROOT": str(data_root)}
    out = subprocess.run([sys.executable, "-c", DRIVER, str(sources), json.dumps(RUN_CONFIG),
                          json.dumps(JOB_CONFIGS)],
                         env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT")]
    assert lines, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT"):])


def run_embedded(sources: Path, data_root: Path, monkeypatch: pytest.MonkeyPatch) -> list:
    from prx_assets.demo.runner import materialize_all

    monkeypatch.setenv("PRX_DATA_ROOT", str(data_root))
    runs = materialize_all(sources, dg.DagsterInstance.ephemeral(), RUN_CONFIG, semantic=True,
                           job_run_configs=JOB_CONFIGS)
    assert all(run.success for run in runs), [(r.source, r.checks) for r in runs]
    return runs


def table_contents(path: Path) -> pa.Table:
    table = lance.dataset(str(path)).to_table()
    table = table.drop_columns([c for c in table.column_names if c in VOLATILE])
    keys = [c for c in ("id", "caption_version", "request_id") if c in table.column_names]
    return table.sort_by([(key, "ascending") for key in keys])


def assert_same_table(left: Path, right: Path) -> None:
    a, b = table_contents(left), table_contents(right)
    assert a.schema == b.schema and a.num_rows == b.num_rows, left
    for name in a.column_names:
        if name in APPROXIMATE:
            x = np.array(a.column(name).to_pylist(), dtype=np.float64)
            y = np.array(b.column(name).to_pylist(), dtype=np.float64)
            np.testing.assert_allclose(x, y, atol=1e-5, err_msg=f"{left}:{name}")
        else:
            assert a.column(name).equals(b.column(name)), f"{left}: column {name} differs"


def assert_funnel(runs: list, sources: Path, root: Path, capsys) -> None:
    """Every file decodable and kept, the planted copies found; the summary prints the
    funnel."""
    from prx_assets.definitions import build_defs
    from prx_assets.demo.runner import print_summary
    from prx_assets.stages.report.funnel import source_funnel

    resources = build_defs(sources).resources
    funnel = source_funnel(root, "web", resources["captioner"].caption_version(),
                           resources["classifier"].classifier_version())
    assert (funnel.raw, funnel.decodable, funnel.kept, funnel.captioned, funnel.labelled,
            funnel.in_shards, funnel.duplicates) == (FILES,) * 6 + (COPIES,)
    assert COPIES <= funnel.skipped < FILES and funnel.streamed == FILES - funnel.skipped
    print_summary(runs, sources)
    printed = capsys.readouterr().out
    assert "samples in shards" in printed and f"{funnel.streamed:>9,}" in printed


def lance_tables(root: Path) -> list[str]:
    """Global tables (lance/<asset>.lance) and per-source ones (lance/<asset>/<source>.lance)."""
    found = [*root.glob("lance/*.lance"), *root.glob("lance/*/*.lance")]
    return sorted(str(p.relative_to(root)) for p in found)


def tree_files(data_root: Path, source: str) -> dict[str, bytes]:
    tree = (data_root / "mds" / source).resolve()
    return {str(p.relative_to(tree)): p.read_bytes() for p in sorted(tree.rglob("*"))
            if p.is_file()}


@pytest.mark.cluster
def test_whole_graph_on_a_two_node_cluster_matches_embedded(
        cluster, tmp_path: Path, ray_session, monkeypatch: pytest.MonkeyPatch, capsys):
    write_corpus(tmp_path / "images")
    sources = write_sources(tmp_path / "sources.yaml",
                            [f"{{name: web, kind: image_folder, uri: {tmp_path / 'images'}}}"])
    cluster_root, embedded_root = tmp_path / "cluster", tmp_path / "embedded"

    result = run_on_cluster(cluster[0], sources, cluster_root)
    # corpus, embeddings, semantic steps, dedup, skip lists, corpus table
    assert result["success"] == [True] * 6
    # Ingest, the image stage and the semantic steps ran tasks on both nodes (the driver
    # records the node of every written block, the semantic steps each task's node).
    for step in ("raw_images", "bucketed_images", "semantic_duplicates", "concepts"):
        assert result["nodes"][step] == 2, (step, result["nodes"])
    # Dedup records where its groups were formed, but Ray Data's sort-based groupby runs
    # one reduce task per input block (`num_partitions` is for the hash shuffle): one
    # fragment of 20 phashes here, one task; ~10^3 at 10^9 rows.
    assert result["nodes"]["duplicates"] >= 1

    runs = run_embedded(sources, embedded_root, monkeypatch)
    assert_funnel(runs, sources, embedded_root, capsys)

    tables = lance_tables(embedded_root)
    assert tables == lance_tables(cluster_root)
    assert {"lance/raw_images/web.lance", "lance/mds_samples/web.lance",
            "lance/duplicates.lance", "lance/corpus.lance"} <= set(tables)
    assert set(tables) >= SPACE_ORDERED
    for name in tables:
        if name in SPACE_ORDERED:
            ids = [table_contents(root / name).column("id") for root in (cluster_root,
                                                                          embedded_root)]
            assert ids[0].equals(ids[1]), name
        else:
            assert_same_table(cluster_root / name, embedded_root / name)

    cluster_tree, embedded_tree = tree_files(cluster_root, "web"), tree_files(embedded_root, "web")
    assert sorted(cluster_tree) == sorted(embedded_tree)
    assert any(name.endswith(".skip.json") for name in cluster_tree)  # the planted copies
    # The tree manifest names its own build (a timestamped version); everything else in it
    # (the input versions read, the sample count) must agree.
    manifests = [json.loads(tree.pop("tree.json")) for tree in (cluster_tree, embedded_tree)]
    # The cards name their own tree version and build time too; what they count is
    # the tables' content, compared above.
    for tree in (cluster_tree, embedded_tree):
        tree.pop("card.json"), tree.pop("card.md")
    assert [{k: v for k, v in m.items() if k != "tree_version"} for m in manifests] == [
        {k: v for k, v in manifests[1].items() if k != "tree_version"}] * 2
    different = [name for name in cluster_tree if cluster_tree[name] != embedded_tree[name]]
    assert different == [], different
    assert os.path.islink(cluster_root / "mds" / "web")


@pytest.mark.cluster
@pytest.mark.timeout(2400)
def test_the_graph_on_a_two_node_cluster_with_the_data_root_in_a_bucket(
        cluster, tmp_path: Path, s3_server, s3_root):
    """PRX_DATA_ROOT in the bucket, each node (and the driver) with a work folder of its own:
    every table lands in the bucket, both nodes did work, no node keeps scratch behind.
    The nodes got the AWS variables when they started (the `cluster` fixture); the driver
    gets them from this process's environment (the s3_root fixture put them there)."""
    from prx_assets.testing.s3_runs import (
        GLOBAL_TABLES,
        PER_SOURCE_TABLES,
        SOURCE,
        assert_mds_in_bucket,
        keys_under,
        run_graph,
        upload_source,
        write_webdataset,
    )

    # The source is in the bucket too: no node reads a local copy of it.
    # Four tars: ingest reads one tar per task, so both nodes get some.
    source_uri = upload_source(s3_server, write_webdataset(tmp_path / "wds", items=16, tars=4),
                               f"{s3_root}-sources")
    sources = write_sources(tmp_path / "sources.yaml",
                            [f"{{name: {SOURCE}, kind: webdataset, uri: {source_uri}}}"])
    started, node_folders = cluster
    folders = {**node_folders, **{name: tmp_path / name for name in ("driver", "cwd")}}
    for name in ("driver", "cwd"):
        folders[name].mkdir()
    env = {**started.driver_env(), **s3_server.env(), "PRX_DATA_ROOT": s3_root,
           "TMPDIR": str(folders["driver"]), "DAGSTER_HOME": str(tmp_path),
           "HF_HUB_OFFLINE": "1"}
    report = run_graph(sources, env, folders["cwd"])
    for job, outcome in report.items():
        assert outcome["success"], (job, outcome["failures"])
        assert set(outcome["failed_checks"].values()) <= {"WARN"}, (job, outcome)
    nodes = report["source_job"]["ray_nodes"]
    assert nodes["raw_images"] == 2 and nodes["bucketed_images"] == 2, report["source_job"]
    keys = keys_under(s3_server, s3_root)
    for table in PER_SOURCE_TABLES:
        assert any(k.startswith(f"lance/{table}/{SOURCE}.lance/_versions/") for k in keys), table
    for table in GLOBAL_TABLES:
        assert any(k.startswith(f"lance/{table}.lance/_versions/") for k in keys), table
    # The shards and the skip lists too: versioned prefixes, the pointer, the sidecars.
    assert "mds_shards" in report["source_job"]["materialized"]
    assert report["skip_lists_job"]["materialized"] == ["skip_lists"]
    assert_mds_in_bucket(keys)
    for name, folder in folders.items():
        left = [p for p in folder.rglob("*") if p.is_file() and "prx-work" in p.parts]
        assert left == [], (name, left)
    assert list(folders["cwd"].iterdir()) == []
