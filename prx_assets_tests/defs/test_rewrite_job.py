import gc

import dagster as dg

from prx_assets.definitions import build_defs
from prx_assets.stages.shards import mds, plan
from prx_assets.stages.skip_lists.skip_lists import (
    apply_skip_lists,
    build_skip_lists,
    mapping_batches,
    mapping_shards,
)
from prx_assets.storage import trees
from prx_assets.storage.layout import Storage
from prx_assets.storage.sidecars import sidecar_files
from prx_assets.testing.mds_corpus import ACTIVE, build_corpus, inputs_for
from prx_assets.testing.shared_memory import release_shared_memory
from prx_assets.testing.sources import write_sources


def _ids(root) -> set[str]:
    mapping = Storage(root).table("mds_samples", "web")
    return set(mapping.to_table(columns=["id"]).column("id").to_pylist())


def test_rewrite_job_drops_skipped_samples_and_records_the_new_tree(data_root, tmp_path):
    release_shared_memory(data_root)
    build_corpus(data_root, "web", per_shape=10, shapes=((1, 48, 48), (1, 64, 48)))
    mds.write_mds_tree(inputs_for(data_root, "web"), data_root, "web",
                       plan.WriteOptions(size_limit=8_000, parallel=False))
    instance = dg.DagsterInstance.ephemeral()
    instance.report_runless_asset_event(dg.AssetMaterialization(
        "mds_shards", partition="web", metadata={"caption_version": ACTIVE}))
    mapping = Storage(data_root).table("mds_samples", "web")
    before = _ids(data_root)
    skipped = set(sorted(before)[::3])
    shards, _ = mapping_shards(mapping)
    apply_skip_lists(trees.current_tree(data_root, "web"),
                     build_skip_lists(mapping_batches(mapping), {"dedup": skipped}), shards)

    defs = build_defs(write_sources(tmp_path / "s.yaml",
                                    ["{name: web, kind: image_folder, uri: /tmp}"]))
    result = defs.resolve_job_def("rewrite_shards_job").execute_in_process(
        partition_key="web", instance=instance,
        run_config={"ops": {"rewrite_shards": {"config": {"parallel": False,
                                                          "size_limit_mb": 1}}}},
        resources={"ray_cluster": dg.ResourceDefinition.none_resource()})
    assert result.success
    assert _ids(data_root) == before - skipped
    assert sidecar_files(trees.current_tree(data_root, "web")) == []
    events = {e.event_specific_data.materialization.asset_key.path[-1]:
              e.event_specific_data.materialization.metadata
              for e in result.get_asset_materialization_events()}
    assert events["mds_shards"]["excluded_by_rewrite"].value == len(skipped)
    assert events["mds_shards"]["samples"].value == len(before - skipped)
    assert events["skip_lists"]["skipped"].value == 0
    gc.collect()
    release_shared_memory(data_root)
