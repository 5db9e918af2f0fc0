import dataclasses
import io
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from PIL import Image
from streaming import Stream

from prx_assets.stages.shards import mds, parts, plan
from prx_assets.stages.shards.card import CARD_JSON, CARD_MD
from prx_assets.stages.shards.mapping import MDS_SAMPLES_SCHEMA
from prx_assets.storage import trees
from prx_assets.storage.layout import Storage
from prx_assets.storage.refs import Location
from prx_assets.testing.mds_corpus import build_corpus, inputs_for
from prx_assets.testing.shared_memory import plain_dataset, release_shared_memory

SMALL = plan.WriteOptions(size_limit=60_000, rows_per_part=7)  # several parts and shards per leaf


def _q92_tables() -> dict:
    buffer = io.BytesIO()
    Image.new("RGB", (32, 32), "gray").save(buffer, "JPEG", quality=92, subsampling=0)
    return Image.open(buffer).quantization


def _raw_jpeg(image: Image.Image) -> bytes:
    # The `jpeg` decoder opens the stored bytes with Image.open(BytesIO(data)): the buffer it
    # holds is exactly what the shard stores.
    return image.fp.getvalue()


def test_tree_holds_the_kept_captioned_rows_byte_for_byte(ray_session, data_root):
    corpus = build_corpus(data_root, "web")
    report = mds.write_mds_tree(inputs_for(data_root, "web"), data_root, "web", SMALL)

    assert report.samples == len(corpus["images"])
    assert report.left_out == {"no_caption": len(corpus["no_caption"])}
    assert {leaf.name for leaf in report.leaves} == {"1/64x64", "1/48x80", "1/80x48", "2/96x96"}
    assert report.shards > len(report.leaves)  # size_limit split the leaves
    tree = trees.current_tree(data_root, "web")
    assert tree == report.path and os.path.islink(data_root / "mds" / "web")
    assert trees.current_tree(data_root / "mds", "web") == tree  # the MDS root works too

    mapping = Storage(data_root).table("mds_samples", "web").to_table()
    assert mapping.schema == MDS_SAMPLES_SCHEMA
    assert sorted(mapping["id"].to_pylist()) == sorted(corpus["images"])
    assert set(mapping["tree_version"].to_pylist()) == {report.tree_version}
    where = {r["id"]: r for r in mapping.to_pylist()}

    # The trainer's loader: one stream per folder holding an index.json under the source.
    walked = sorted(Path(d) for d, _, files in os.walk(data_root / "mds" / "web")
                    if "index.json" in files)
    assert [p.relative_to(data_root / "mds" / "web") for p in walked] == [
        p.relative_to(tree) for p in trees.tree_leaves(tree)]

    q92 = _q92_tables()
    for leaf in trees.tree_leaves(tree):
        release_shared_memory(data_root)
        dataset = plain_dataset(local=str(leaf), shuffle=False, batch_size=1)
        rel = str(leaf.relative_to(tree))
        assert dataset.num_samples == sum(r["leaf"] == rel for r in where.values())
        ids = []
        for i in range(dataset.num_samples):
            sample = dataset[i]
            ids.append(sample["id"])
            image = sample["image"]
            assert _raw_jpeg(image) == corpus["images"][sample["id"]]  # never re-encoded
            assert image.convert("RGB").mode == "RGB" and image.mode == "RGB"
            assert image.size == (sample["width"], sample["height"])
            assert image.quantization == q92  # quality 92 read back from the tables
            assert sample["caption"] == f"a picture {sample['id']}"
            assert sample["source"] == "web"
            assert sample["original_width"] == 3 * sample["width"]
            row = where[sample["id"]]
            shard_start = sum(s["samples"] for s in _shards(leaf)[:int(row["shard"][6:11])])
            assert (row["leaf"], shard_start + row["sample_index"]) == (rel, i)
        assert ids == sorted(ids)  # id order within a leaf
        del dataset


def _shards(leaf: Path) -> list[dict]:
    return json.loads((leaf / "index.json").read_text())["shards"]


def test_same_inputs_give_byte_identical_trees(ray_session, data_root):
    build_corpus(data_root, "web", per_shape=6)
    full = dataclasses.replace(SMALL, incremental=False)  # a rebuild, not "nothing changed"
    first = mds.write_mds_tree(inputs_for(data_root, "web"), data_root, "web", full)
    second = mds.write_mds_tree(inputs_for(data_root, "web"), data_root, "web", full)
    assert first.tree_version != second.tree_version
    # The manifest and the card name their own version (and when it was written).
    per_version = (trees.TREE_MANIFEST, CARD_JSON, CARD_MD)
    files = sorted(p.relative_to(first.path) for p in first.path.rglob("*")
                   if p.is_file() and p.name not in per_version)
    assert files and files == sorted(p.relative_to(second.path) for p in second.path.rglob("*")
                                     if p.is_file() and p.name not in per_version)
    for rel in files:
        assert (first.path / rel).read_bytes() == (second.path / rel).read_bytes(), rel
    assert trees.current_tree(data_root, "web") == second.path
    # No retention: a superseded tree no reader lease holds goes at the next publish.
    third = mds.write_mds_tree(inputs_for(data_root, "web"), data_root, "web",
                               dataclasses.replace(full, retention=timedelta(0)))
    # Superseded, past the zero retention, no reader lease: both older trees are removed.
    assert not first.path.exists() and not second.path.exists()
    assert trees.current_tree(data_root, "web") == third.path


_KILLED_WRITER = """
import sys, time
from pathlib import Path
from prx_assets.stages.shards import mds, merge, plan
from prx_assets.testing.mds_corpus import inputs_for
root, flag = Path(sys.argv[1]), Path(sys.argv[2])
merge_leaf = merge.merge_leaf
def merge_then_hang(*args, **kwargs):
    shards = merge_leaf(*args, **kwargs)
    flag.write_text("merging")  # some of the new tree is on disk
    time.sleep(600)
merge.merge_leaf = merge_then_hang
mds.write_mds_tree(inputs_for(root, "web"), root, "web",
                   plan.WriteOptions(size_limit=60_000, rows_per_part=7, parallel=False))
"""


@pytest.mark.e2e  # a build in a subprocess, killed
def test_a_killed_build_leaves_the_previous_tree_current(data_root, tmp_path):
    corpus = build_corpus(data_root, "web", per_shape=6)
    before = mds.write_mds_tree(inputs_for(data_root, "web"), data_root, "web",
                                plan.WriteOptions(size_limit=60_000, parallel=False))
    mapping_table = Storage(data_root).table("mds_samples", "web")
    mapping_version = mapping_table.latest_version()
    build_corpus(data_root, "web", per_shape=8)  # new samples: the killed build appends

    flag = tmp_path / "flag"
    child = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(data_root), str(flag)],
                             env={**os.environ, "PYTHONPATH": os.getcwd(), "PRX_LEASE_TTL_S": "1"})
    try:
        deadline = time.time() + 240
        while not flag.exists():
            assert child.poll() is None, "writer exited before the kill"
            assert time.time() < deadline, "writer never reached the merge"
            time.sleep(0.2)
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    finally:
        if child.poll() is None:
            child.kill()

    partial = list((data_root / "mds" / ".trees" / "web").glob("*" + trees.PARTIAL_SUFFIX))
    assert partial, "the kill should have left a partial build behind"
    assert trees.current_tree(data_root, "web") == before.path
    assert mapping_table.latest_version() == mapping_version
    release_shared_memory(data_root)
    streams = [Stream(local=str(leaf)) for leaf in trees.tree_leaves(before.path)]
    dataset = plain_dataset(streams=streams, shuffle=False, batch_size=1)
    assert sorted(dataset[i]["id"] for i in range(dataset.num_samples)) == sorted(corpus["images"])
    del dataset

    after = mds.write_mds_tree(inputs_for(data_root, "web"), data_root, "web",
                               plan.WriteOptions(parallel=False))
    assert not any(p.exists() for p in partial)  # a rerun clears the leftovers
    assert after.samples == 4 * 8 - 2 and trees.current_tree(data_root, "web") == after.path


def test_excluded_ids_are_left_out_and_counted(data_root):
    corpus = build_corpus(data_root, "web", per_shape=4)
    drop = sorted(corpus["images"])[:3]
    inputs = inputs_for(data_root, "web")
    inputs = plan.SampleInputs(**{**inputs.__dict__, "exclude_ids": pa.array(drop)})
    report = mds.write_mds_tree(inputs, data_root, "web", plan.WriteOptions(parallel=False))
    assert report.left_out == {"excluded": 3, "no_caption": 2}
    assert report.samples == len(corpus["images"]) - 3


def test_a_real_folder_in_place_of_the_tree_link_is_refused(data_root):
    build_corpus(data_root, "web", per_shape=2)
    (data_root / "mds" / "web").mkdir(parents=True)
    (data_root / "mds" / "web" / "keep.txt").write_text("not ours")
    with pytest.raises(RuntimeError, match="real folder"):
        mds.write_mds_tree(inputs_for(data_root, "web"), data_root, "web",
                           plan.WriteOptions(parallel=False))


def test_small_parts_share_a_task_and_keep_their_order():
    specs = [parts.PartSpec(out=Location(f"leaf{i}"), ids=[f"x{i}"] * n, image_rows=np.arange(n),
                      caption_rows=np.arange(n)) for i, n in enumerate([3, 4, 10, 2, 2])]
    groups = parts.task_groups(specs, rows_per_task=8)
    assert [[spec.out.name for spec in group] for group in groups] == [
        ["leaf0", "leaf1"], ["leaf2"], ["leaf3", "leaf4"]]


def test_every_cpu_gets_a_task_when_the_parts_are_small():
    n = parts.MIN_ROWS_PER_TASK
    specs = [parts.PartSpec(out=Location(f"leaf{i}"), ids=["x"] * n, image_rows=np.arange(n),
                          caption_rows=np.arange(n)) for i in range(6)]
    assert parts.rows_per_task(specs, rows_per_part=50_000, cpus=2) == 3 * n
    assert parts.rows_per_task(specs, rows_per_part=n, cpus=2) == n
    assert len(parts.task_groups(specs, parts.rows_per_task(specs, 50_000, cpus=2))) == 2
    # A small source stays one task: a worker's imports cost more than a split saves.
    assert parts.rows_per_task(specs[:1], rows_per_part=50_000, cpus=8) == n
