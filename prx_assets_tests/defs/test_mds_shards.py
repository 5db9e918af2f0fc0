import dagster as dg

from prx_assets.defs.resources import CaptionerResource, RayResource, StorageResource
from prx_assets.defs.shards import build_mds_shards, mds_tree_check
from prx_assets.stages.shards import verify
from prx_assets.storage import trees
from prx_assets.storage.lance_tables import overwrite_rows
from prx_assets.storage.layout import Storage
from prx_assets.testing.dagster_results import checks
from prx_assets.testing.mds_corpus import ACTIVE, build_corpus


def _materialize(instance, version=ACTIVE):
    partitions = dg.StaticPartitionsDefinition(["web"])
    return dg.materialize(
        [build_mds_shards(partitions), mds_tree_check(partitions)], partition_key="web",
        instance=instance, raise_on_error=False,
        resources={"ray_cluster": RayResource(), "storage": StorageResource(),
                   "captioner": CaptionerResource(active_version=version)})


def test_mds_shards_writes_the_tree_with_metadata_and_check(ray_session, data_root):
    corpus = build_corpus(data_root, "web", per_shape=5)
    instance = dg.DagsterInstance.ephemeral()
    result = _materialize(instance)
    assert result.success
    assert checks(result) == {"mds_shards:leaves_stream": True}

    meta = result.asset_materializations_for_node("mds_shards")[0].metadata
    assert meta["samples"].value == len(corpus["images"]) == meta["dagster/row_count"].value
    per_leaf = meta["samples_by_tier_and_shape"].value.records
    assert sum(r.data["samples"] for r in per_leaf) == len(corpus["images"])
    assert {(r.data["tier"], r.data["shape"]) for r in per_leaf} == {
        (1, "64x64"), (1, "48x80"), (1, "80x48"), (2, "96x96")}
    reasons = {r.data["reason"]: r.data["count"] for r in meta["left_out_by_reason"].value.records}
    assert reasons == {"no_caption": len(corpus["no_caption"])}
    assert meta["caption_version"].value == ACTIVE
    assert meta["stage_seconds"].value > 0
    assert meta["stage_seconds_in_words"].value.endswith(("s", "min"))
    tree = trees.current_tree(data_root, "web")
    assert meta["tree_version"].value == tree.name
    mapping = Storage(data_root).table("mds_samples", "web")
    assert meta["mapping_lance_version"].value == mapping.latest_version()

    # An older caption version is another corpus: every row has a usable "old-v0" caption.
    older = _materialize(instance, version="old-v0")
    assert older.success
    assert older.asset_materializations_for_node("mds_shards")[0].metadata[
        "samples"].value == len(corpus["images"]) + len(corpus["no_caption"])


def test_check_fails_when_a_leaf_and_the_mapping_disagree(ray_session, data_root):
    build_corpus(data_root, "web", per_shape=3)
    instance = dg.DagsterInstance.ephemeral()
    assert _materialize(instance).success
    leaf = trees.tree_leaves(trees.current_tree(data_root, "web"))[0]
    mapping = Storage(data_root).table("mds_samples", "web")
    table = mapping.to_table()
    leaf_name = str(leaf.relative_to(trees.current_tree(data_root, "web")))
    keep = [r for r in table.to_pylist() if r["leaf"] != leaf_name][1:]
    overwrite_rows(mapping, table.from_pylist(keep, schema=table.schema), table.schema)
    found, problems = verify.verify_tree(data_root, "web")
    assert not all(c.ok for c in found) and not problems


def test_build_defs_wires_mds_shards_after_bucketed_images_and_captions(tmp_path):
    from prx_assets.definitions import build_defs
    from prx_assets.testing.sources import write_sources

    sources = write_sources(tmp_path / "s.yaml",
                            [f"{{name: web, kind: image_folder, uri: {tmp_path}}}"])
    graph = build_defs(sources).resolve_asset_graph()
    key = dg.AssetKey("mds_shards")
    assert graph.get(key).parent_keys == {dg.AssetKey("bucketed_images"), dg.AssetKey("captions")}
    assert dg.AssetCheckKey(key, "leaves_stream") in graph.asset_check_keys


def test_incremental_counts_and_an_unchanged_rerun_keeps_the_data_version(ray_session, data_root):
    from prx_assets.testing.mds_corpus import NEW_ID, add_sample, remove_sample

    corpus = build_corpus(data_root, "web", per_shape=3)
    instance = dg.DagsterInstance.ephemeral()

    def run():
        result = _materialize(instance)
        assert result.success
        event = result.asset_materializations_for_node("mds_shards")[0]
        return event.metadata, event.tags["dagster/data_version"]

    meta, first_version = run()
    assert (meta["rows_processed"].value, meta["rows_reused"].value,
            meta["rows_removed"].value) == (len(corpus["images"]), 0, 0)
    assert meta["compared"].value == "every id"
    add_sample(data_root, NEW_ID)
    remove_sample(data_root, sorted(corpus["images"])[0])
    meta, second_version = run()
    assert (meta["rows_processed"].value, meta["rows_reused"].value,
            meta["rows_removed"].value) == (1, len(corpus["images"]) - 1, 1)
    assert meta["appended"].value and second_version != first_version
    assert meta["ids_compared"].value == 2  # the inputs' changes: one id each
    meta, third_version = run()
    assert (meta["rows_processed"].value, meta["rows_removed"].value) == (0, 0)
    assert meta["ids_compared"].value == 0
    assert not meta["new_tree"].value and third_version == second_version
