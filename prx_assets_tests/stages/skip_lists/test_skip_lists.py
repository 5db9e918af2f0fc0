import json
import os
import threading

import pyarrow as pa
import pytest

from prx_assets.stages.dedup.dedup import DUPLICATES_SCHEMA
from prx_assets.stages.skip_lists.skip_lists import (
    apply_skip_lists,
    build_skip_lists,
    duplicate_ids,
    label_ids,
    mapping_batches,
    mapping_shards,
    read_ablations,
    skipped_ids,
)
from prx_assets.storage.lance_tables import overwrite_rows
from prx_assets.storage.refs import TableRef
from prx_assets.storage.sidecars import read_sidecar, sidecar_path, skipped_indices, write_sidecar


def _table(where: TableRef, rows: pa.Table) -> TableRef:
    overwrite_rows(where, rows, rows.schema)
    return where


def _mapping(tmp_path, rows_per_shard=5, shards=("shard.00000.mds", "shard.00001.mds")):
    rows = []
    for leaf in ("512/512x512", "1024/1024x1024"):
        for s, shard in enumerate(shards):
            for i in range(rows_per_shard):
                rows.append({"id": f"web:{leaf[:3]}-{s}-{i}", "leaf": leaf, "shard": shard,
                             "sample_index": i})
    return _table(TableRef.of(tmp_path / "mds_samples.lance"), pa.Table.from_pylist(rows))


def test_lists_per_shard_and_reason_are_sorted_shard_local_indices(tmp_path):
    uri = _mapping(tmp_path)
    reasons = {"dedup": {"web:512-0-3", "web:512-0-1", "other:x"},
               "optout": {"web:102-1-4"}, "nsfw": {"web:512-0-3"}, "text": set()}
    lists = build_skip_lists(mapping_batches(uri, batch_rows=3), reasons)
    assert lists == {("512/512x512", "shard.00000.mds"): {"dedup": [1, 3], "nsfw": [3]},
                     ("1024/1024x1024", "shard.00001.mds"): {"optout": [4]}}
    shards, per_leaf = mapping_shards(uri, batch_rows=3)
    assert len(shards) == 4 and per_leaf == {"512/512x512": 10, "1024/1024x1024": 10}

    tree = tmp_path / "tree"
    for leaf, shard in shards:
        (tree / leaf).mkdir(parents=True, exist_ok=True)
        (tree / leaf / shard).write_bytes(b"shard bytes")
    report = apply_skip_lists(tree, lists, shards)
    assert (report.written, report.removed, report.unchanged) == (2, 0, 2)
    assert report.skipped_per_reason == {"dedup": 2, "nsfw": 1, "optout": 1}
    assert report.skipped_per_leaf == {"512/512x512": 2, "1024/1024x1024": 1}  # union per leaf
    sidecar = tree / "512/512x512/shard.00000.skip.json"
    assert json.loads(sidecar.read_text()) == {"version": 1,
                                               "lists": {"dedup": [1, 3], "nsfw": [3]}}
    assert {p.name for p in (tree / "512/512x512").iterdir()} == {
        "shard.00000.mds", "shard.00001.mds", "shard.00000.skip.json"}
    assert all((tree / leaf / shard).read_bytes() == b"shard bytes" for leaf, shard in shards)

    # An opt-out withdrawn and the dedup list emptied: the stale sidecar goes away.
    again = apply_skip_lists(tree, {("512/512x512", "shard.00000.mds"): {"dedup": [1, 3],
                                                                         "nsfw": [3]}}, shards)
    assert (again.written, again.removed, again.unchanged) == (0, 1, 3)
    assert not (tree / "1024/1024x1024/shard.00001.skip.json").exists()


def test_skipped_ids_come_back_as_one_arrow_array_of_unique_ids(tmp_path):
    # A rewrite may skip tens of millions of samples: the ids stay Arrow, never a Python
    # string each; a shard met in several mapping batches counts its samples once.
    uri = _mapping(tmp_path)
    reasons = {"dedup": pa.array(["web:512-0-3", "web:512-0-1", "web:102-1-4"]),
               "nsfw": {"web:512-0-3"}}
    lists = build_skip_lists(mapping_batches(uri, batch_rows=3), reasons)
    shards, _ = mapping_shards(uri)
    tree = tmp_path / "tree"
    for leaf in {leaf for leaf, _ in shards}:
        (tree / leaf).mkdir(parents=True)
    apply_skip_lists(tree, lists, shards)
    found = skipped_ids(tree, uri, batch_rows=2)
    assert isinstance(found, pa.Array) and found.type == pa.string()
    assert sorted(found.to_pylist()) == ["web:102-1-4", "web:512-0-1", "web:512-0-3"]
    assert skipped_ids(tree, uri, ["nsfw"]).to_pylist() == ["web:512-0-3"]
    assert len(skipped_ids(tree, uri, ["optout"])) == 0


def test_sidecar_roundtrip_and_union_of_selected_reasons(tmp_path):
    path = sidecar_path(tmp_path / "shard.00007.mds")
    assert path.name == "shard.00007.skip.json"
    assert read_sidecar(path) == {}  # absent: nothing skipped
    write_sidecar(path, {"text": [9, 2, 2], "dedup": [5], "empty": []})
    assert read_sidecar(path) == {"dedup": [5], "text": [2, 9]}
    assert skipped_indices(read_sidecar(path)) == {2, 5, 9}
    assert skipped_indices(read_sidecar(path), ["dedup", "optout"]) == {5}
    path.write_text(json.dumps({"version": 2, "lists": {}}))
    with pytest.raises(ValueError, match="version"):
        read_sidecar(path)


def test_sidecar_replaced_atomically_under_concurrent_readers(tmp_path):
    path = tmp_path / "shard.00000.skip.json"
    big = {"dedup": list(range(0, 200_000, 2))}
    small = {"dedup": [1]}
    write_sidecar(path, small)
    seen, errors, stop = set(), [], threading.Event()

    def reader():
        while not stop.is_set():
            try:
                seen.add(len(read_sidecar(path)["dedup"]))
            except Exception as exc:  # a torn read would fail to parse
                errors.append(exc)

    thread = threading.Thread(target=reader)
    thread.start()
    for i in range(30):
        write_sidecar(path, big if i % 2 == 0 else small)
    stop.set()
    thread.join()
    assert not errors and seen <= {1, 100_000}
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp files left


def test_failed_write_leaves_previous_sidecar(tmp_path, monkeypatch):
    path = tmp_path / "shard.00000.skip.json"
    write_sidecar(path, {"dedup": [1]})

    def crash(src, dst):
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        write_sidecar(path, {"dedup": [1, 2]})
    assert read_sidecar(path) == {"dedup": [1]}
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_ablation_lists_are_named_files_of_ids(tmp_path):
    (tmp_path / "no_cats.txt").write_text("web:1\n# reviewed 2026-11\n\nweb:2  # blurry\n")
    assert read_ablations(tmp_path) == {"no_cats": {"web:1", "web:2"}}
    assert read_ablations(tmp_path / "absent") == {}
    (tmp_path / "Bad Name.txt").write_text("x\n")
    with pytest.raises(ValueError, match="must match"):
        read_ablations(tmp_path)


def test_ablation_names_cannot_shadow_built_in_reasons(tmp_path):
    (tmp_path / "dedup.txt").write_text("web:1\n")
    with pytest.raises(ValueError, match="built-in"):
        read_ablations(tmp_path)


def test_labels_come_from_the_active_versions_only_and_dedup_skips_non_kept(tmp_path):
    labels = TableRef.of(tmp_path / "caption_labels.lance")
    rows = [("web:1", "cap2", "cls2", "text"), ("web:2", "cap2", "cls2", "nsfw"),
            ("web:3", "cap2", "cls2", "visual"), ("web:4", "cap1", "cls2", "text"),
            ("web:5", "cap2", "cls1", "nsfw"), ("web:6", "cap'2", "cls2", "text")]
    _table(labels, pa.table({k: [r[i] for r in rows] for i, k in enumerate(
        ["id", "caption_version", "classifier_version", "label"])}))
    assert label_ids(labels, ["text", "nsfw"], "cap2", "cls2") == {
        "text": {"web:1"}, "nsfw": {"web:2"}}
    assert label_ids(labels, ["text"], "cap'2", "cls2") == {"text": {"web:6"}}  # quoted
    assert label_ids(TableRef.of(tmp_path / "absent.lance"), ["text"], "cap2", "cls2") == {
        "text": set()}

    duplicates = _table(TableRef.of(tmp_path / "duplicates.lance"), pa.Table.from_pylist([
        {"id": "web:1", "kept_id": "web:1", "phash": 1, "group_size": 3},
        {"id": "web:2", "kept_id": "web:1", "phash": 1, "group_size": 3},
        {"id": "web_b:2", "kept_id": "web:1", "phash": 1, "group_size": 3}],
        schema=DUPLICATES_SCHEMA))
    assert duplicate_ids(duplicates, "web") == {"web:2"}  # not the kept copy, not web_b
    assert duplicate_ids(duplicates, "web_b") == {"web_b:2"}


def test_stale_lists_are_kept_whatever_the_reasons_say(tmp_path):
    from prx_assets.storage.sidecars import REASON_STALE

    tree = tmp_path / "tree"
    (tree / "1/64x64").mkdir(parents=True)
    write_sidecar(tree / "1/64x64/shard.00000.skip.json", {REASON_STALE: [2], "dedup": [0]})
    write_sidecar(tree / "1/64x64/shard.00001.skip.json", {REASON_STALE: [0, 1]})  # all stale
    shards = {("1/64x64", "shard.00000.mds")}  # the all-stale shard has no live mapping row
    report = apply_skip_lists(tree, {("1/64x64", "shard.00000.mds"): {
        "nsfw": [1], REASON_STALE: [5]}}, shards)  # a list can't make samples stale
    assert read_sidecar(tree / "1/64x64/shard.00000.skip.json") == {"nsfw": [1],
                                                                    REASON_STALE: [2]}
    assert read_sidecar(tree / "1/64x64/shard.00001.skip.json") == {REASON_STALE: [0, 1]}
    assert report.skipped_per_reason == {"nsfw": 1, REASON_STALE: 3}
    with pytest.raises(ValueError, match="built-in"):
        (tmp_path / "abl").mkdir()
        (tmp_path / "abl" / "stale.txt").write_text("web:1\n")
        read_ablations(tmp_path / "abl")


def test_ablation_lists_are_read_from_an_object_store(s3_root):
    from prx_assets.storage.layout import Storage

    folder = Storage(s3_root).ablations_dir
    (folder / "no_cats.txt").write_text("web:1\n# a comment\nweb:2  # why\n")
    (folder / "readme.md").write_text("not a list")
    assert read_ablations(folder) == {"no_cats": {"web:1", "web:2"}}
    assert read_ablations(f"{s3_root}/absent") == {}


def test_dedup_and_label_reasons_are_read_from_a_bucket(s3_server, s3_root, monkeypatch):
    """On an object-store root the reasons come from the tables in the bucket (a `Path`
    existence test there would read every table as absent: no dedup, no label skips), with
    the storage options handed in (the environment holds a wrong secret)."""
    from prx_assets.storage.layout import Storage

    store = Storage(s3_root, {"aws_secret_access_key": s3_server.secret_key})
    duplicates, labels = store.table("duplicates"), store.table("caption_labels", "web")
    _table(duplicates, pa.Table.from_pylist([
        {"id": "web:1", "kept_id": "web:1", "phash": 1, "group_size": 2},
        {"id": "web:2", "kept_id": "web:1", "phash": 1, "group_size": 2}],
        schema=DUPLICATES_SCHEMA))
    _table(labels, pa.table({"id": ["web:3"], "caption_version": ["cap"],
                             "classifier_version": ["cls"], "label": ["text"]}))
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    assert duplicate_ids(duplicates, "web") == {"web:2"}
    assert label_ids(labels, ["text"], "cap", "cls") == {"text": {"web:3"}}
    assert label_ids(store.table("caption_labels", "other"), ["text"], "cap", "cls") == {
        "text": set()}


def test_one_definition_of_what_the_loader_skips_by_default():
    """Hygiene reasons apply by default; balance and every named ablation only when named.
    The label reasons are the labels stage's labels (spelled out for the loader's sake)."""
    from prx_assets.stages.labels.labels import LABELS
    from prx_assets.stages.skip_lists.skip_lists import RESERVED_REASONS
    from prx_assets.storage.sidecars import (
        DEFAULT_REASONS,
        LABEL_REASONS,
        applies_by_default,
        by_default,
        opt_in,
    )

    assert set(LABELS) == LABEL_REASONS
    for reason in ("dedup", "semdedup", "text", "nsfw", "optout", "rights", "stale"):
        assert applies_by_default(reason), reason
    for reason in ("balance", "no_blue", "ablation_1"):
        assert not applies_by_default(reason), reason
    assert DEFAULT_REASONS | {"balance"} == RESERVED_REASONS
    lists = {"dedup": [1], "balance": [2, 3], "no_blue": [4]}
    assert by_default(lists) == {"dedup": [1]}
    assert opt_in(lists) == {"balance": [2, 3], "no_blue": [4]}


def test_skip_shares_count_default_reasons_and_opt_in_lists_apart(tmp_path):
    from prx_assets.stages.skip_lists.skip_lists import skip_shares, tree_skips
    from prx_assets.storage.refs import as_location

    leaf = tmp_path / "512" / "512x512"
    leaf.mkdir(parents=True)
    write_sidecar(sidecar_path(leaf / "shard.00000.mds"),
                  {"dedup": [0, 1], "semdedup": [1], "balance": [2, 3, 4], "no_blue": [5]})
    write_sidecar(sidecar_path(leaf / "shard.00001.mds"), {"stale": [0]})
    shares = skip_shares(as_location(tmp_path), {"512/512x512": 20})
    stream = shares["512/512x512"]
    assert stream.samples == 21  # 20 live + 1 stale, stored and read past
    assert stream.skips.skipped == 3  # samples 0 and 1 once each, and the stale one
    assert stream.share == 3 / 21
    assert stream.skips.by_reason == {"dedup": 2, "semdedup": 1, "stale": 1}
    assert stream.skips.opt_in == {"balance": 3, "no_blue": 1}
    assert tree_skips(as_location(tmp_path)).skipped == 3


def test_an_apply_report_counts_default_skips_apart_from_opt_in_lists(tmp_path):
    leaf = tmp_path / "512" / "512x512"
    leaf.mkdir(parents=True)
    key = ("512/512x512", "shard.00000.mds")
    report = apply_skip_lists(tmp_path, {key: {"dedup": [0], "balance": [0, 1, 2]}}, [key])
    assert (report.skipped_total, report.skipped_by_default) == (3, 1)
    assert report.skipped_per_reason == {"dedup": 1, "balance": 3}
