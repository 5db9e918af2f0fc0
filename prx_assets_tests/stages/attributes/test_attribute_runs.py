"""Tagging a source's captions: a few in the run's own process, many in an actor pool, the
same records either way."""

from prx_assets.stages.attributes.runs import AttributerSpec, tag_source
from prx_assets.storage.refs import TableRef
from prx_assets_tests.fixtures.labelled_captions import labelled_test_captions, write_captions

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
        assert report.to_tag == len(rows) and report.written == len(rows)
        tables[name] = attributes.latest().to_table().drop_columns(["created_at"]) \
            .sort_by("id")
    assert tables["here"].equals(tables["pool"])
