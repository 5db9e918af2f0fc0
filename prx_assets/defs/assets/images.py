"""bucketed_images and phashes: one decode per image, two tables.

The Ray pass writes bucketed_images with the hash columns riding along; phashes is then a
projection of the freshly committed table (no second decode, no image bytes read).
"""

from typing import Iterator, Optional

import dagster as dg
import ray.data

from prx_assets.s2_images.buckets import BucketRule, DEFAULT_TIERS
from prx_assets.s2_images.stage import (
    BUCKETED_SCHEMA, PHASH_COLUMNS, PHASH_SCHEMA, RAW_COLUMNS, build_bucketed_dataset)
from prx_assets.s2_images.imaging import DEFAULT_QUALITY, DEFAULT_SUBSAMPLING, ImageOptions
from prx_assets.storage.lance_tables import table_uri
from prx_assets.storage.settings import data_root
from prx_assets.storage.table_stats import bucket_profile
from prx_assets.defs.io_managers import (
    COLUMNS_KEY, FRAGMENT_BYTES_KEY, FRAGMENT_ROWS_KEY, PROFILE_KEY, LanceTableOutput)
from prx_assets.defs.lineage import input_versions
from prx_assets.defs.resources import RayResource


class ImageStageConfig(dg.Config):
    tiers: list[int] = list(DEFAULT_TIERS)
    alignment: int = 16
    min_aspect: float = 0.5
    max_aspect: float = 2.0
    resize_mode: str = "crop"  # or "stretch"
    jpeg_quality: int = DEFAULT_QUALITY
    subsampling: str = DEFAULT_SUBSAMPLING
    draft_margin: Optional[float] = 2.0
    reducing_gap: Optional[float] = 3.0
    max_pixels: int = 200_000_000

    def options(self) -> ImageOptions:
        rule = BucketRule(tiers=tuple(self.tiers), alignment=self.alignment,
                          min_aspect=self.min_aspect, max_aspect=self.max_aspect)
        return ImageOptions(rule=rule, quality=self.jpeg_quality, subsampling=self.subsampling,
                            resize_mode=self.resize_mode, draft_margin=self.draft_margin,
                            reducing_gap=self.reducing_gap, max_pixels=self.max_pixels)


def build_image_stage(partitions_def: dg.PartitionsDefinition) -> dg.AssetsDefinition:
    @dg.multi_asset(
        partitions_def=partitions_def,
        group_name="images",
        ins={"raw_images": dg.AssetIn(metadata={COLUMNS_KEY: RAW_COLUMNS})},
        outs={
            "bucketed_images": dg.AssetOut(
                io_manager_key="lance_io_manager", kinds={"ray", "lance"}, code_version="1",
                metadata={FRAGMENT_BYTES_KEY: 512 << 20, PROFILE_KEY: "bucketed_images"},
                description="Every raw image filtered, bucketed to a tier and shape, resized "
                            "with Lanczos and stored as JPEG Q92; rejects keep their reason."),
            "phashes": dg.AssetOut(
                io_manager_key="lance_io_manager", kinds={"lance"}, code_version="1",
                metadata={FRAGMENT_ROWS_KEY: 1 << 20, FRAGMENT_BYTES_KEY: 1 << 30},
                description="imagehash-compatible 64-bit DCT phash of each decodable original, "
                            "its pixel count, and whether it is flat (never a duplicate)."),
        },
    )
    def image_stage(context: dg.AssetExecutionContext, config: ImageStageConfig,
                    ray_cluster: RayResource, raw_images: ray.data.Dataset
                    ) -> Iterator[dg.Output]:
        lineage = input_versions(context, "raw_images")
        bucketed = build_bucketed_dataset(raw_images, config.options())
        yield dg.Output(LanceTableOutput(bucketed, BUCKETED_SCHEMA, metadata=lineage),
                        output_name="bucketed_images")
        # The IO manager has committed bucketed_images: project its hash columns.
        uri = table_uri(data_root(), "bucketed_images", context.partition_key)
        profile = bucket_profile(str(uri))
        hashes = ray.data.read_lance(str(uri), columns=PHASH_COLUMNS, filter="phash IS NOT NULL")
        yield dg.Output(LanceTableOutput(hashes, PHASH_SCHEMA, metadata={
            **lineage, "flat_images": profile.flat, "hashed_images": profile.hashed}),
            output_name="phashes")

    return image_stage
