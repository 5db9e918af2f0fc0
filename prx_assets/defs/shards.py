"""mds_shards: each source's kept, captioned images as MDS shards by tier and shape; the
leaves_stream check; rewrite_shards_job, which rebuilds a tree without its skipped samples."""

import time
from datetime import timedelta

import dagster as dg

from prx_assets.defs.asset_leases import asset_lease
from prx_assets.defs.metadata import (
    browser_link,
    content_data_version,
    counts_table,
    incremental_metadata,
    input_lineage,
    latest_data_version,
    latest_recorded,
    pin_inputs,
)
from prx_assets.defs.report import duration_metadata
from prx_assets.defs.resources import CaptionerResource, RayResource, StorageResource
from prx_assets.stages.captions.captions import active_caption_filter
from prx_assets.stages.rewrite.rewrite import pinned_inputs, rewrite_without_skipped
from prx_assets.stages.shards.card import source_licenses
from prx_assets.stages.shards.mds import write_mds_tree
from prx_assets.stages.shards.plan import DEFAULT_ROWS_PER_PART, SampleInputs, WriteOptions
from prx_assets.stages.shards.publish import TreeReport
from prx_assets.stages.shards.verify import verify_tree
from prx_assets.storage.layout import Storage
from prx_assets.storage.tables import (
    BUCKETED_IMAGES,
    CAPTIONS,
    MDS_SHARDS,
    RAW_IMAGES,
    SKIP_LISTS,
)
from prx_assets.storage.trees import DEFAULT_RETENTION

DEFAULT_RETENTION_DAYS = DEFAULT_RETENTION.total_seconds() / 86400


class MdsShardsConfig(dg.Config):
    size_limit_mb: int = 128
    compression: str | None = None  # JPEG does not compress further
    rows_per_part: int = DEFAULT_ROWS_PER_PART
    # A superseded tree is removed this long after it stopped being current, and only when
    # no reader lease holds it (docs/factory.md).
    retention_days: float = DEFAULT_RETENTION_DAYS
    # False: a full build even when only a few samples changed (new shards for everything).
    incremental: bool = True

    def options(self) -> WriteOptions:
        return WriteOptions(size_limit=self.size_limit_mb << 20, compression=self.compression,
                            rows_per_part=self.rows_per_part,
                            retention=timedelta(days=self.retention_days),
                            incremental=self.incremental)


def sample_inputs(context: dg.AssetExecutionContext, store: Storage,
                  caption_version: str) -> SampleInputs:
    """Both inputs pinned as every stage pins them (`pin_inputs`), the versions recorded as
    lineage."""
    source = context.partition_key
    inputs = pin_inputs(store, source, BUCKETED_IMAGES, CAPTIONS)
    raw = store.table(RAW_IMAGES, source)
    return SampleInputs(
        bucketed=inputs[BUCKETED_IMAGES], captions=inputs[CAPTIONS],
        caption_filter=active_caption_filter(caption_version),
        license=source_licenses([source])[source], raw=raw.pinned() if raw.exists() else None)


def build_mds_shards(partitions_def: dg.PartitionsDefinition) -> dg.AssetsDefinition:
    @dg.asset(
        name=MDS_SHARDS, partitions_def=partitions_def, group_name="mds", kinds={"ray", "lance"},
        code_version="1", deps=[dg.AssetKey(BUCKETED_IMAGES), dg.AssetKey(CAPTIONS)],
        description="Kept images with a usable active caption as ~128 MB MDS shards, one "
                    "stream per tier and shape under mds/<source>, swapped in atomically; "
                    "lance/mds_samples/<source>.lance maps each id to its shard.")
    def mds_shards(context: dg.AssetExecutionContext, config: MdsShardsConfig,
                   ray_cluster: RayResource, captioner: CaptionerResource,
                   storage: StorageResource) -> dg.MaterializeResult:
        caption_version = captioner.caption_version()
        store = storage.get()
        with asset_lease(context, store):
            source = context.partition_key
            started = time.monotonic()
            inputs = sample_inputs(context, store, caption_version)
            report = write_mds_tree(inputs, store, source, config.options(),
                                    log=context.log.info)
            seconds = time.monotonic() - started
            previous = latest_data_version(context.instance, MDS_SHARDS, source)
            return dg.MaterializeResult(
                metadata={**tree_metadata(report), "caption_version": caption_version,
                          **incremental_metadata(report.processed, report.reused, report.removed),
                          "appended": report.appended, "new_tree": report.changed,
                          **compared_metadata(report.compared_ids),
                          **duration_metadata("stage_seconds", seconds),
                          **input_lineage({BUCKETED_IMAGES: inputs.bucketed.version,
                                           CAPTIONS: inputs.captions.version}),
                          **browser_link(context)},
                # The tree version names the content: unchanged when nothing changed.
                data_version=content_data_version(previous, report.changed, report.mapping_version,
                                                  report.tree_version))

    return mds_shards


def compared_metadata(compared_ids: int | None) -> dict:
    """Which ids the run compared with the mapping: those its inputs' changes handed it
    (stages.shards.handed), or every id of the source."""
    if compared_ids is None:
        return {"compared": "every id"}
    return {"compared": "ids handed by the inputs' changes", "ids_compared": compared_ids}


def tree_metadata(report: TreeReport) -> dict:
    leaves = dg.MetadataValue.table(
        [dg.TableRecord({"tier": leaf.tier, "shape": f"{leaf.width}x{leaf.height}",
                         "samples": leaf.samples, "shards": leaf.shards,
                         "mb": round(leaf.bytes / 1e6, 2)}) for leaf in report.leaves],
        schema=dg.TableSchema(columns=[
            dg.TableColumn("tier", "int"), dg.TableColumn("shape", "string"),
            dg.TableColumn("samples", "int"), dg.TableColumn("shards", "int"),
            dg.TableColumn("mb", "float")]))
    return {
        "path": dg.MetadataValue.path(str(report.path)),
        "tree_version": report.tree_version,
        "dagster/row_count": report.samples,
        "samples": report.samples, "shards": report.shards,
        "mds_mb": round(report.bytes / 1e6, 2),
        "samples_by_tier_and_shape": leaves,
        "left_out": report.left_out.total(),
        "left_out_by_reason": counts_table(report.left_out, "reason"),
        "mapping_lance_version": report.mapping_version,
    }


def mds_tree_check(partitions_def: dg.PartitionsDefinition) -> dg.AssetChecksDefinition:
    @dg.asset_check(asset=dg.AssetKey(MDS_SHARDS), name="leaves_stream",
                    partitions_def=partitions_def, blocking=True,
                    description="Every leaf opens with streaming.StreamingDataset and holds as "
                                "many samples as the mapping table says.")
    def leaves_stream(context: dg.AssetCheckExecutionContext,
                      storage: StorageResource) -> dg.AssetCheckResult:
        checks, problems = verify_tree(storage.get(), context.partition_key, context.log.info)
        bad = [c.leaf for c in checks if not c.ok]
        table = dg.MetadataValue.table(
            [dg.TableRecord({"leaf": c.leaf, "streamed": c.streamed, "mapped": c.mapped})
             for c in checks],
            schema=dg.TableSchema(columns=[dg.TableColumn("leaf", "string"),
                                           dg.TableColumn("streamed", "int"),
                                           dg.TableColumn("mapped", "int")]))
        return dg.AssetCheckResult(passed=not bad and not problems, metadata={
            "leaves": table, "mismatched_leaves": ", ".join(bad) or "none",
            "problems": "; ".join(problems) or "none"})

    return leaves_stream


class RewriteConfig(dg.Config):
    # Reasons whose samples leave the shards; None: the reasons in the sidecars the loader
    # applies by default. Reasons not listed (the opt-in balance and ablation lists unless
    # named) stay skip lists of the new tree.
    reasons: list[str] | None = None
    size_limit_mb: int = 128
    rows_per_part: int = DEFAULT_ROWS_PER_PART
    retention_days: float = DEFAULT_RETENTION_DAYS
    parallel: bool = True


def tree_caption_version(instance: dg.DagsterInstance, source: str) -> str:
    """The caption version the current tree was built with (mds_shards records it)."""
    value = latest_recorded(instance, MDS_SHARDS, source, "caption_version")
    if value is None:
        raise dg.Failure(f"no mds_shards materialisation with a caption_version for {source}: "
                         "materialise mds_shards first")
    return str(value)


@dg.op(description="Rebuild the partition's MDS tree without the samples its skip lists "
                   "skip, from the current tree's pinned inputs; swap it in atomically.")
def rewrite_shards(context: dg.OpExecutionContext, config: RewriteConfig,
                   ray_cluster: RayResource, storage: StorageResource):
    source, store = context.partition_key, storage.get()
    caption_version = tree_caption_version(context.instance, source)
    inputs = pinned_inputs(store, source, active_caption_filter(caption_version))
    options = WriteOptions(size_limit=config.size_limit_mb << 20,
                           rows_per_part=config.rows_per_part,
                           retention=timedelta(days=config.retention_days),
                           parallel=config.parallel)
    with asset_lease(context, store, MDS_SHARDS):  # the same writer as mds_shards
        report = rewrite_without_skipped(inputs, store, source, config.reasons, options,
                                         log=context.log.info)
    tree = report.tree
    yield dg.AssetMaterialization(asset_key=MDS_SHARDS, partition=source, metadata={
        "path": dg.MetadataValue.path(str(tree.path)), "tree_version": tree.tree_version,
        "samples": tree.samples, "shards": tree.shards, "caption_version": caption_version,
        "mapping_lance_version": tree.mapping_version, "rewrite": True,
        "rewritten_reasons": ", ".join(report.rewritten_reasons) or "none",
        "excluded_by_rewrite": report.excluded,
        **input_lineage({BUCKETED_IMAGES: inputs.bucketed.version,
                         CAPTIONS: inputs.captions.version})})
    carried = report.carried_over
    yield dg.AssetMaterialization(asset_key=SKIP_LISTS, partition=source, metadata={
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


def shard_defs(partitions_def: dg.PartitionsDefinition) -> dg.Definitions:
    return dg.Definitions(assets=[build_mds_shards(partitions_def)],
                          asset_checks=[mds_tree_check(partitions_def)],
                          jobs=[build_rewrite_job(partitions_def)])
