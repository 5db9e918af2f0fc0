"""Tagging a source's captions: a few in the run's own process, many in an actor pool, the
same records either way."""

from prx_assets.stages.attributes.runs import AttributerSpec, tag_source
from prx_assets.storage.refs import TableRef
from prx_assets.testing.labelled_captions import labelled_test_captions, write_captions

CAPTION_FILTER = "caption_version = 'v1' AND status = 'ok'"


def test_a_few_captions_are_tagged_in_this_process_as_the_actor_pool_tags_them(
        ray_session, tmp_path):
    captions = TableRef.of(tmp_path / "captions.lance")
    rows = labelled_test_captions()
    write_captions(captions, [(i, c) for i, c, _ in rows], "v1")
    tables = {}
    for name, in_process_rows in (("here", 64), ("pool", 0)):
        attributes = TableRef.of(tmp_path / f"attributes-{name}.lance")
        spec = AttributerSpec(batch_size=4, in_process_rows=in_process_rows)
        report = tag_source(captions, attributes, "v1", CAPTION_FILTER, spec)
        assert report.to_do == len(rows) and report.written == len(rows)
        tables[name] = attributes.latest().to_table().drop_columns(["created_at"]) \
            .sort_by("id")
    assert tables["here"].equals(tables["pool"])


def test_a_run_with_the_record_of_the_captions_tags_only_what_changed(
        ray_session, tmp_path, monkeypatch):
    """After a run that left every caption with a final record, the next is handed the
    captions written since (a new one, one written again) from the record in the
    attributes table, and never compares every caption with every record."""
    import lance

    from prx_assets.stages.attributes import runs
    from prx_assets.stages.captions import consumers
    from prx_assets.storage.changes import read_consumed

    captions = TableRef.of(tmp_path / "captions.lance")
    attributes = TableRef.of(tmp_path / "attributes.lance")
    rows = labelled_test_captions()
    write_captions(captions, [(i, c) for i, c, _ in rows], "v1")
    spec = AttributerSpec(batch_size=4)
    assert tag_source(captions, attributes, "v1", CAPTION_FILTER, spec).written == len(rows)
    assert read_consumed(attributes, "captions",
                         consumers.record_tag("v1", spec.version())) is not None

    def compared_in_full(*args, **kwargs):
        raise AssertionError("compared every caption with every record")

    monkeypatch.setattr(runs, "tagged_ids", compared_in_full)
    again, _, _ = rows[0]
    lance.dataset(str(captions)).delete(f"id = '{again}'")  # its source item changed
    write_captions(captions, [(again, "A green bicycle against a brick wall."),
                              ("web:new", "A wooden boat on a calm lake at dawn.")], "v1")
    report = tag_source(captions, attributes, "v1", CAPTION_FILTER, spec)
    assert (report.to_do, report.written) == (2, 2)
    records = attributes.latest().to_table().to_pylist()
    assert len(records) == len(rows) + 1 == len({r["id"] for r in records})
    assert tag_source(captions, attributes, "v1", CAPTION_FILTER, spec).to_do == 0


def test_caption_records_are_tagged_by_a_pool_as_large_as_the_labellers(ray_session):
    """The plan Ray Data runs (built, not executed): the caption backend in as many actors
    as the cluster has CPUs (one left a core idle for the whole stage), a local model in
    one actor unless told (each holds its weights)."""
    import ray
    import ray.data

    from prx_assets.stages.attributes.runs import attribute_stage

    rows = ray.data.from_items([{"id": "a", "caption_version": "v1", "caption": "A barn."}])
    cpus = int(ray.cluster_resources()["CPU"])
    caption = attribute_stage(rows, AttributerSpec(), rows=1000)._logical_plan.dag.compute
    assert (caption.min_size, caption.max_size) == (1, cpus)
    local = attribute_stage(rows, AttributerSpec(backend="transformers", model="/weights"),
                            rows=1000)._logical_plan.dag.compute
    assert local.min_size == local.max_size == 1
    assert attribute_stage(rows, AttributerSpec(actors=3), rows=1000) \
        ._logical_plan.dag.compute.max_size == 3
