"""rewrite_shards_job: rebuild one source's MDS tree without its skipped samples."""

from typing import Optional

import dagster as dg

from prx_assets.s7_shards.mds import DEFAULT_ROWS_PER_PART, WriteOptions
from prx_assets.s3_captions.captions import active_caption_filter
from prx_assets.s7_shards.rewrite import pinned_inputs, rewrite_without_skipped
from prx_assets.storage.settings import data_root
from prx_assets.defs.resources import RayResource


class RewriteConfig(dg.Config):
    # Reasons whose samples leave the shards; None: every reason in the sidecars. Reasons
    # not listed (e.g. ablations still being compared) stay skip lists of the new tree.
    reasons: Optional[list[str]] = None
    size_limit_mb: int = 128
    rows_per_part: int = DEFAULT_ROWS_PER_PART
    keep_trees: int = 2
    parallel: bool = True


def tree_caption_version(instance: dg.DagsterInstance, source: str) -> str:
    """The caption version the current tree was built with (mds_shards records it)."""
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey("mds_shards"), asset_partitions=[source]),
        limit=1).records
    value = records[0].asset_materialization.metadata.get("caption_version") if records else None
    if value is None:
        raise dg.Failure(f"no mds_shards materialisation with a caption_version for {source}: "
                         "materialise mds_shards first")
    return str(value.value)


@dg.op(description="Rebuild the partition's MDS tree without the samples its skip lists "
                   "skip, from the current tree's pinned inputs; swap it in atomically.")
def rewrite_shards(context: dg.OpExecutionContext, config: RewriteConfig,
                   ray_cluster: RayResource):
    source = context.partition_key
    caption_version = tree_caption_version(context.instance, source)
    inputs = pinned_inputs(data_root(), source, active_caption_filter(caption_version))
    options = WriteOptions(size_limit=config.size_limit_mb << 20,
                           rows_per_part=config.rows_per_part, keep_trees=config.keep_trees,
                           parallel=config.parallel)
    report = rewrite_without_skipped(inputs, data_root(), source, config.reasons, options,
                                     log=context.log.info)
    tree = report.tree
    yield dg.AssetMaterialization(asset_key="mds_shards", partition=source, metadata={
        "path": dg.MetadataValue.path(str(tree.path)), "tree_version": tree.tree_version,
        "samples": tree.samples, "shards": tree.shards, "caption_version": caption_version,
        "mapping_lance_version": tree.mapping_version, "rewrite": True,
        "rewritten_reasons": ", ".join(report.rewritten_reasons) or "none",
        "excluded_by_rewrite": report.excluded,
        "input_version/bucketed_images": inputs.bucketed_version or -1,
        "input_version/captions": inputs.captions_version or -1})
    carried = report.carried_over
    yield dg.AssetMaterialization(asset_key="skip_lists", partition=source, metadata={
        "tree": dg.MetadataValue.path(str(tree.path)), "samples": tree.samples,
        "skipped": carried.skipped_total,
        "carried_over_reasons": ", ".join(sorted(carried.skipped_per_reason)) or "none"})
    yield dg.Output(None)


def build_rewrite_job(partitions_def: dg.PartitionsDefinition) -> dg.JobDefinition:
    @dg.job(name="rewrite_shards_job", partitions_def=partitions_def,
            description="One source's shards rebuilt without skipped samples (recommended by "
                        "the skipped_share check above ~10 %); the loader yields the same ids.")
    def rewrite_shards_job():
        rewrite_shards()

    return rewrite_shards_job
