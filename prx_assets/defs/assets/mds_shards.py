"""mds_shards: each source's kept, captioned images as MDS shards by tier and shape."""

from typing import Optional

import dagster as dg

from prx_assets.s3_captions.captions import active_caption_filter
from prx_assets.storage.lance_tables import table_uri
from prx_assets.s7_shards.mds import (
    DEFAULT_ROWS_PER_PART, SampleInputs, TreeReport, WriteOptions, verify_tree, write_mds_tree)
from prx_assets.storage.settings import data_root
from prx_assets.defs.lineage import input_versions, materialized_lance_version
from prx_assets.defs.metadata import counts_table
from prx_assets.defs.resources import CaptionerResource, RayResource


class MdsShardsConfig(dg.Config):
    size_limit_mb: int = 128
    compression: Optional[str] = None  # JPEG does not compress further
    rows_per_part: int = DEFAULT_ROWS_PER_PART
    keep_trees: int = 2

    def options(self) -> WriteOptions:
        return WriteOptions(size_limit=self.size_limit_mb << 20, compression=self.compression,
                            rows_per_part=self.rows_per_part, keep_trees=self.keep_trees)


def sample_inputs(context: dg.AssetExecutionContext, caption_version: str) -> SampleInputs:
    source, root = context.partition_key, data_root()
    return SampleInputs(
        bucketed_uri=str(table_uri(root, "bucketed_images", source)),
        captions_uri=str(table_uri(root, "captions", source)),
        caption_filter=active_caption_filter(caption_version),
        bucketed_version=materialized_lance_version(
            context.instance, dg.AssetKey("bucketed_images"), source),
        captions_version=materialized_lance_version(
            context.instance, dg.AssetKey("captions"), source))


def build_mds_shards(partitions_def: dg.PartitionsDefinition) -> dg.AssetsDefinition:
    @dg.asset(
        partitions_def=partitions_def, group_name="mds", kinds={"ray", "lance"}, code_version="1",
        deps=[dg.AssetKey("bucketed_images"), dg.AssetKey("captions")],
        description="Kept images with a usable active caption as ~128 MB MDS shards, one "
                    "stream per tier and shape under mds/<source>, swapped in atomically; "
                    "lance/mds_samples/<source>.lance maps each id to its shard.")
    def mds_shards(context: dg.AssetExecutionContext, config: MdsShardsConfig,
                   ray_cluster: RayResource, captioner: CaptionerResource
                   ) -> dg.MaterializeResult:
        caption_version = captioner.caption_version()
        report = write_mds_tree(sample_inputs(context, caption_version), data_root(),
                                context.partition_key, config.options(), log=context.log.info)
        return dg.MaterializeResult(
            metadata={**tree_metadata(report), "caption_version": caption_version,
                      **input_versions(context, "bucketed_images", "captions")},
            data_version=dg.DataVersion(f"{report.tree_version}@{report.mapping_version}"))

    return mds_shards


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
    @dg.asset_check(asset=dg.AssetKey("mds_shards"), name="leaves_stream",
                    partitions_def=partitions_def, blocking=True,
                    description="Every leaf opens with streaming.StreamingDataset and holds as "
                                "many samples as the mapping table says.")
    def leaves_stream(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        checks, problems = verify_tree(data_root(), context.partition_key)
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
