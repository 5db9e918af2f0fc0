import lance
import numpy as np
import pyarrow as pa
import pytest

from prx_assets.stages.captions.consumers import record_tag
from prx_assets.stages.labels import runs
from prx_assets.stages.labels.backends import OpenAISettings
from prx_assets.stages.labels.labels import LABELS_SCHEMA, active_labels_filter
from prx_assets.stages.labels.runs import (
    LabelerSpec,
    drop_orphan_labels,
    label_coverage,
    label_source,
    pool_size,
)
from prx_assets.storage.changes import read_consumed
from prx_assets.storage.refs import TableRef
from prx_assets.testing.labelled_captions import labelled_test_captions, write_captions
from prx_assets.testing.local_chat_server import chat_server


def _filter(version: str) -> str:
    return f"caption_version = '{version}' AND status = 'ok'"


def test_labels_of_ids_without_a_caption_are_deleted_every_version_pair(tmp_path):
    captions = TableRef.of(tmp_path / "captions.lance")
    labels = TableRef.of(tmp_path / "labels.lance")
    lance.write_dataset(pa.table({"id": ["s:1", "s:3"]}), str(captions))
    # Two label rows (two version pairs) for s:2, whose item left the source.
    lance.write_dataset(pa.table({"id": ["s:1", "s:2", "s:2", "s:3"],
                                  "label": ["visual", "text", "text", "nsfw"]}), str(labels))

    assert drop_orphan_labels(labels, captions, chunk=1) == 2
    assert sorted(labels.latest().to_table().column("id").to_pylist()) == ["s:1", "s:3"]
    assert drop_orphan_labels(labels, captions) == 0


def test_embedded_labels_are_incremental_across_caption_versions(ray_session, tmp_path):
    captions = TableRef.of(tmp_path / "captions.lance")
    labels = TableRef.of(tmp_path / "labels.lance")
    rows = labelled_test_captions()
    write_captions(captions, [(i, c) for i, c, _ in rows], "v1")
    write_captions(captions, [("web:refused", "I'm sorry")], "v1", status="refused")
    spec = LabelerSpec(batch_size=4)

    first = label_source(captions, labels, "v1", _filter("v1"), spec, chunk_rows=4)
    assert (first.written, first.failed, first.chunks) == (6, 0, 2)
    table = lance.dataset(str(labels)).to_table()
    assert table.schema == LABELS_SCHEMA
    got = {r["id"]: r for r in table.to_pylist()}
    assert {i: got[i]["label"] for i, _, _ in rows} == {i: label for i, _, label in rows}
    for row in got.values():
        assert row["classifier_version"] == spec.version() and row["caption_version"] == "v1"
        assert abs(np.linalg.norm(row["embedding"]) - 1) < 1e-4
        assert max(row["score_visual"], row["score_text"], row["score_nsfw"]) == \
            row[f"score_{row['label']}"]

    again = label_source(captions, labels, "v1", _filter("v1"), spec)
    assert again.written == 0 and lance.dataset(str(labels)).count_rows() == 6

    # A new caption version: only its captions are labelled; v1's labels stay.
    write_captions(captions, [(i, c) for i, c, _ in rows[:3]], "v2")
    second = label_source(captions, labels, "v2", _filter("v2"), spec)
    assert second.written == 3
    table = lance.dataset(str(labels))
    assert table.count_rows() == 9
    assert table.count_rows(filter=active_labels_filter("v2", spec.version())) == 3
    coverage = label_coverage(captions, labels, _filter("v2"), "v2", spec.version())
    assert (coverage.inputs, coverage.rows(), coverage.share()) == (3, 3, 1.0)


def test_openai_backend_labels_through_the_pool_and_leaves_failures_for_later(
        ray_session, tmp_path):
    captions = TableRef.of(tmp_path / "captions.lance")
    labels = TableRef.of(tmp_path / "labels.lance")
    write_captions(captions, [("s:1", "A screenshot of a settings page."),
                              ("s:2", "A dog asleep on a porch."),
                              ("s:3", "Some gibberish caption.")], "v1")
    with chat_server() as (url, state):
        spec = LabelerSpec("openai", openai=OpenAISettings(url, concurrency=2, retries=0))
        report = label_source(captions, labels, "v1", _filter("v1"), spec)
        assert (report.written, report.failed) == (2, 1)
        assert "not a label" in report.examples[0]
        got = {r["id"]: r["label"] for r in lance.dataset(str(labels)).to_table().to_pylist()}
        assert got == {"s:1": "text", "s:2": "visual"}
        # the failure is retried on the next run, the labelled rows are not re-sent
        before = len(state.requests)
        retry = label_source(captions, labels, "v1", _filter("v1"), spec)
        assert (retry.written, retry.failed, len(state.requests) - before) == (0, 1, 1)
        # A run that left a failure records nothing: the next compares (or is handed) the
        # same captions again.
        assert read_consumed(labels, "captions", record_tag("v1", spec.version())) is None


def test_missing_captions_table_is_a_clear_error(ray_session, tmp_path):
    with pytest.raises(FileNotFoundError, match="materialise captions first"):
        label_source(TableRef.of(tmp_path / "none.lance"), TableRef.of(tmp_path / "labels.lance"),
                     "v1", _filter("v1"), LabelerSpec())


def labelled_once(tmp_path) -> tuple[TableRef, TableRef, list, LabelerSpec]:
    """The test captions of version v1, labelled once (embedded backend)."""
    captions = TableRef.of(tmp_path / "captions.lance")
    labels = TableRef.of(tmp_path / "labels.lance")
    rows = labelled_test_captions()
    write_captions(captions, [(i, c) for i, c, _ in rows], "v1")
    spec = LabelerSpec(batch_size=8)
    label_source(captions, labels, "v1", _filter("v1"), spec)
    return captions, labels, rows, spec


def test_a_caption_written_again_is_labelled_again(ray_session, tmp_path):
    """A changed source file gets a new caption row under the same id and version (the
    captions asset drops the stale one): its old label must not survive."""
    captions, labels, rows, spec = labelled_once(tmp_path)
    changed_id, _, old_label = rows[0]
    new_caption, new_label = next((c, label) for _, c, label in rows if label != old_label)
    lance.dataset(str(captions)).delete(f"id = '{changed_id}'")
    write_captions(captions, [(changed_id, new_caption)], "v1")

    again = label_source(captions, labels, "v1", _filter("v1"), spec)
    assert again.written == 1
    table = lance.dataset(str(labels)).to_table().to_pylist()
    assert len(table) == len(rows)
    assert [r["label"] for r in table if r["id"] == changed_id] == [new_label]


def test_the_pool_grows_to_the_cluster_cpus_unless_told_its_size():
    assert pool_size(LabelerSpec(), cpus=8) == 8
    assert pool_size(LabelerSpec(threads_per_actor=2), cpus=8) == 4
    assert pool_size(LabelerSpec(threads_per_actor=4), cpus=2) == 1
    assert pool_size(LabelerSpec(actors=3), cpus=8) == 3


def test_captions_are_embedded_on_the_gpu_only_when_a_model_labels_them_there():
    assert [LabelerSpec(backend=b).embedding_device() for b in ("embedded", "vllm")] == \
        ["cpu", "cuda"]
    openai = OpenAISettings("http://127.0.0.1:1/v1")
    assert LabelerSpec(backend="openai", openai=openai).embedding_device() == "cpu"
    assert LabelerSpec(backend="vllm", embed_device="cpu").embedding_gpus() == 0.0
    assert LabelerSpec(backend="vllm").embedding_gpus() == pytest.approx(0.1)
    whole = LabelerSpec(backend="vllm", vllm=runs.VLLMSettings(gpu_share=1.0))
    assert whole.embedding_gpus() == 1.0  # the engine leaves nothing: a GPU of its own
    with pytest.raises(ValueError, match="embed_device"):
        LabelerSpec(embed_device="gpu")


def test_the_vllm_labeller_shares_each_gpu_between_its_engine_and_the_embedder(ray_session):
    """The plan Ray Data runs (built, not executed: no vLLM here): MiniLM in an actor per
    engine replica on the GPU share the engine leaves, the two summing to whole GPUs."""
    import ray.data

    spec = LabelerSpec(backend="vllm", vllm=runs.VLLMSettings(concurrency=2))
    plan = runs.label_stage(ray.data.from_items([{"id": "a", "caption_version": "v",
                                                  "caption": "A barn."}]), spec, 1000)
    ops, op = {}, plan._logical_plan.dag
    while op is not None:
        ops[op.name] = op
        op = op.input_dependencies[0] if op.input_dependencies else None
    embed = ops["MapBatches(EmbeddingStage)"]
    engine = ops["MapBatches(vLLMEngineStageUDF)"]
    assert embed.fn_constructor_kwargs["device"] == "cuda"
    assert embed.compute.max_size == embed.compute.min_size == 2  # one per replica
    gpus = embed.ray_remote_args["num_gpus"] + engine.ray_remote_args["num_gpus"]
    assert gpus == pytest.approx(1.0)


def test_the_pool_starts_at_full_size_only_with_work_for_every_actor(ray_session):
    from prx_assets.stages.labels.runs import CAPTIONS_PER_ACTOR, actor_pool

    spec = LabelerSpec(actors=2)
    assert actor_pool(spec, pending=2 * CAPTIONS_PER_ACTOR).initial_size == 2
    small = actor_pool(spec, pending=2 * CAPTIONS_PER_ACTOR - 1)
    assert (small.initial_size, small.min_size, small.max_size) == (1, 1, 2)


def test_a_few_captions_are_labelled_in_this_process_as_the_actor_pool_labels_them(
        ray_session, tmp_path):
    captions = TableRef.of(tmp_path / "captions.lance")
    rows = labelled_test_captions()
    write_captions(captions, [(i, c) for i, c, _ in rows], "v1")
    tables = {}
    for name, in_process_rows in (("here", 64), ("pool", 0)):
        labels = TableRef.of(tmp_path / f"labels-{name}.lance")
        spec = LabelerSpec(batch_size=4, in_process_rows=in_process_rows)
        assert label_source(captions, labels, "v1", _filter("v1"), spec).written == len(rows)
        tables[name] = labels.latest().to_table().drop_columns(["created_at"]).sort_by("id")
    assert tables["here"].equals(tables["pool"])


def test_a_run_with_the_record_of_the_captions_is_handed_their_changes(
        ray_session, tmp_path, monkeypatch):
    """After a run that labelled every caption, the next is handed the captions written
    since and the ids whose caption left (from the record in the labels table), and never
    compares every caption with every label; a run that left failures records nothing."""
    captions, labels, rows, spec = labelled_once(tmp_path)
    tag = record_tag("v1", spec.version())
    assert read_consumed(labels, "captions", tag) is not None

    def compared_in_full(*args, **kwargs):
        raise AssertionError("compared every caption with every label")

    monkeypatch.setattr(runs, "labelled_ids", compared_in_full)
    monkeypatch.setattr(runs, "drop_orphan_labels", compared_in_full)
    gone, _, _ = rows[1]
    lance.dataset(str(captions)).delete(f"id = '{gone}'")  # its item left the source
    write_captions(captions, [("web:new", "A wooden boat on a calm lake at dawn.")], "v1")
    report = label_source(captions, labels, "v1", _filter("v1"), spec)
    assert (report.to_do, report.written, report.removed) == (1, 1, 1)
    ids = sorted(lance.dataset(str(labels)).to_table().column("id").to_pylist())
    assert ids == sorted([i for i, _, _ in rows if i != gone] + ["web:new"])
    assert label_source(captions, labels, "v1", _filter("v1"), spec).to_do == 0
