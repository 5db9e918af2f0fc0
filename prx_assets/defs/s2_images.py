"""bucketed_images and phashes: one decode per image, two tables.

The Ray pass writes bucketed_images with the hash columns riding along; phashes is then a
projection of the freshly committed table (no second decode, no image bytes read).
"""

from typing import Iterator, Optional

import dagster as dg
import ray.data

from prx_assets.s2_images import pil_backend
from prx_assets.s2_images.buckets import BucketRule, DEFAULT_TIERS
from prx_assets.s2_images.fidelity import fidelity_report
from prx_assets.s2_images.imaging import DEFAULT_QUALITY, DEFAULT_SUBSAMPLING, ImageOptions
from prx_assets.s2_images.stage import (
    BUCKETED_SCHEMA, PHASH_COLUMNS, PHASH_SCHEMA, RAW_COLUMNS, build_bucketed_dataset)
from prx_assets.storage.table_stats import bucket_profile
from prx_assets.storage.tables import BUCKETED_IMAGES, PHASHES, RAW_IMAGES
from prx_assets.defs.io_managers import (
    COLUMNS_KEY, FRAGMENT_BYTES_KEY, FRAGMENT_ROWS_KEY, PROFILE_KEY, LanceTableOutput)
from prx_assets.defs.metadata import input_versions
from prx_assets.defs.resources import RayResource, StorageResource
from prx_assets.defs.table_checks import table_checks


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
        ins={RAW_IMAGES: dg.AssetIn(metadata={COLUMNS_KEY: RAW_COLUMNS})},
        outs={
            BUCKETED_IMAGES: dg.AssetOut(
                io_manager_key="lance_io_manager", kinds={"ray", "lance"}, code_version="1",
                metadata={FRAGMENT_BYTES_KEY: 512 << 20, PROFILE_KEY: BUCKETED_IMAGES},
                description="Every raw image filtered, bucketed to a tier and shape, resized "
                            "with Lanczos and stored as JPEG Q92; rejects keep their reason."),
            PHASHES: dg.AssetOut(
                io_manager_key="lance_io_manager", kinds={"lance"}, code_version="1",
                metadata={FRAGMENT_ROWS_KEY: 1 << 20, FRAGMENT_BYTES_KEY: 1 << 30},
                description="imagehash-compatible 64-bit DCT phash of each decodable original, "
                            "its pixel count, and whether it is flat (never a duplicate)."),
        },
    )
    def image_stage(context: dg.AssetExecutionContext, config: ImageStageConfig,
                    ray_cluster: RayResource, storage: StorageResource,
                    raw_images: ray.data.Dataset) -> Iterator[dg.Output]:
        lineage = input_versions(context, RAW_IMAGES)
        bucketed = build_bucketed_dataset(raw_images, config.options())
        # The Pillow build decides speed and (within 0.2 dB) pixels: the workers run this
        # environment's, so the driver's is the one that ran.
        backend = pil_backend.current()
        yield dg.Output(LanceTableOutput(bucketed, BUCKETED_SCHEMA, metadata={
            **lineage, "image_backend": backend.name, "image_backend_version": backend.version}),
            output_name=BUCKETED_IMAGES)
        # The IO manager has committed bucketed_images: project its hash columns from the
        # version just written (a concurrent rewrite cannot change what phashes holds).
        bucketed_table = storage.get().open(BUCKETED_IMAGES, context.partition_key)
        profile = bucket_profile(bucketed_table.uri)
        hashes = ray.data.read_lance(bucketed_table.uri, version=bucketed_table.version,
                                     columns=PHASH_COLUMNS, filter="phash IS NOT NULL")
        yield dg.Output(LanceTableOutput(hashes, PHASH_SCHEMA, metadata={
            **lineage, "flat_images": profile.flat, "hashed_images": profile.hashed}),
            output_name=PHASHES)

    return image_stage


class FidelityConfig(dg.Config):
    samples_per_band: int = 16
    min_median_psnr_1x: float = 40.0
    min_median_psnr_10x: float = 38.0
    quality: int = DEFAULT_QUALITY
    subsampling: str = DEFAULT_SUBSAMPLING
    resize_mode: str = "crop"


def jpeg_fidelity_check(partitions_def: dg.PartitionsDefinition) -> dg.AssetChecksDefinition:
    @dg.asset_check(asset=dg.AssetKey(BUCKETED_IMAGES), name="jpeg_fidelity",
                    partitions_def=partitions_def,
                    description="PSNR after 1 and 10 decode/encode cycles at Q92 on a fixed "
                                "sample, per resolution band, next to the published figures.")
    def jpeg_fidelity(context: dg.AssetCheckExecutionContext, config: FidelityConfig,
                      storage: StorageResource) -> dg.AssetCheckResult:
        bucketed = storage.get().table(BUCKETED_IMAGES, context.partition_key)
        raw = storage.get().table(RAW_IMAGES, context.partition_key)
        options = ImageOptions(quality=config.quality, subsampling=config.subsampling,
                               resize_mode=config.resize_mode)
        reports = [r.stats() for r in fidelity_report(bucketed, raw, options,
                                                      config.samples_per_band) if r.samples]
        failing = [r["band"] for r in reports
                   if r["median_1x"] < config.min_median_psnr_1x
                   or r["median_10x"] < config.min_median_psnr_10x]
        columns = ["band", "samples", "median_1x", "p10_1x", "median_10x", "p10_10x",
                   "published_1x", "published_10x", "median_stored"]
        table = dg.MetadataValue.table(
            [dg.TableRecord(r) for r in reports],
            schema=dg.TableSchema(columns=[dg.TableColumn(c, "string" if c == "band" else "float")
                                           for c in columns]))
        return dg.AssetCheckResult(passed=not failing, metadata={
            "psnr_db": table, "failing_bands": ", ".join(failing) or "none",
            "floor_1x": config.min_median_psnr_1x, "floor_10x": config.min_median_psnr_10x,
            "sampled": sum(r["samples"] for r in reports)})

    return jpeg_fidelity


def image_defs(partitions_def: dg.PartitionsDefinition) -> dg.Definitions:
    return dg.Definitions(
        assets=[build_image_stage(partitions_def)],
        asset_checks=[*table_checks(BUCKETED_IMAGES, partitions_def, with_reject_share=False),
                      *table_checks(PHASHES, partitions_def, with_reject_share=False),
                      jpeg_fidelity_check(partitions_def)])
