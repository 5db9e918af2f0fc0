"""bucketed_images and phashes: one decode per image, two tables, incremental per row.

The asset commits its own tables in bounded chunks (stages.images.stage.run_image_stage): a
run redoes only the raw rows that are new, changed (sha256) or made under other settings,
removes the ids gone from raw_images, and a killed run keeps every committed chunk. It
records `lance_version` per table, so downstream inputs load through the Lance IO manager
pinned to what was materialised, and a data version that moves only when rows changed.
"""

from collections.abc import Iterator

import dagster as dg
import ray.data

from prx_assets.defs.asset_leases import asset_lease
from prx_assets.defs.io_managers import (
    COLUMNS_KEY,
    FRAGMENT_BYTES_KEY,
    FRAGMENT_ROWS_KEY,
    table_metadata,
)
from prx_assets.defs.metadata import (
    Inputs,
    bucket_metadata,
    content_data_version,
    latest_data_version,
    pin_inputs,
    stage_result,
)
from prx_assets.defs.per_source_checks import table_checks
from prx_assets.defs.report import cost_metadata, duration_metadata, reject_sheet_metadata
from prx_assets.defs.resources import RayResource, StorageResource
from prx_assets.engine.progress import StageProgress
from prx_assets.engine.stage import PER_SOURCE_FRAGMENTS
from prx_assets.stages.images import pil_backend
from prx_assets.stages.images.buckets import DEFAULT_TIERS, BucketRule
from prx_assets.stages.images.fidelity import fidelity_report
from prx_assets.stages.images.imaging import DEFAULT_QUALITY, DEFAULT_SUBSAMPLING, ImageOptions
from prx_assets.stages.images.stage import (
    RAW_COLUMNS,
    ImageRunReport,
    ImageTables,
    run_image_stage,
    settings_fingerprint,
)
from prx_assets.stages.report.cost import DEFAULT_CPU_HOUR_USD, DEFAULT_GPU_HOUR_USD
from prx_assets.storage.lance_tables import FragmentPolicy, describe_write
from prx_assets.storage.layout import Storage
from prx_assets.storage.retention import blob_grace
from prx_assets.storage.table_stats import bucket_profile
from prx_assets.storage.tables import BUCKETED_IMAGES, PHASHES, RAW_IMAGES

# Blobs: superseded versions freed after a short grace, not held a week.
BUCKETED_FRAGMENTS = FragmentPolicy(target_bytes=512 << 20, superseded_grace=blob_grace())
PHASH_FRAGMENTS = PER_SOURCE_FRAGMENTS


class ImageStageConfig(dg.Config):
    # dg.Config is a pydantic model: it copies field defaults per instance, and a ClassVar
    # (what RUF012 asks for) would drop the field from the run config schema.
    tiers: list[int] = list(DEFAULT_TIERS)  # noqa: RUF012
    alignment: int = 16
    min_aspect: float = 0.5
    max_aspect: float = 2.0
    resize_mode: str = "crop"  # or "stretch"
    jpeg_quality: int = DEFAULT_QUALITY
    subsampling: str = DEFAULT_SUBSAMPLING
    draft_margin: float | None = 2.0
    reducing_gap: float | None = 3.0
    max_pixels: int = 200_000_000
    # Rows per commit: what a kill can lose, and what the driver holds at once (resized
    # JPEGs, ~100-300 KB each). Not a setting of the output: changing it redoes nothing.
    chunk_rows: int = 512
    # Price of the CPU machine the stage runs on, for `cost_per_1000_images` (an assumption
    # by default: stages/report/cost.py).
    cpu_hour_usd: float = DEFAULT_CPU_HOUR_USD

    def options(self) -> ImageOptions:
        rule = BucketRule(tiers=tuple(self.tiers), alignment=self.alignment,
                          min_aspect=self.min_aspect, max_aspect=self.max_aspect)
        return ImageOptions(rule=rule, quality=self.jpeg_quality, subsampling=self.subsampling,
                            resize_mode=self.resize_mode, draft_margin=self.draft_margin,
                            reducing_gap=self.reducing_gap, max_pixels=self.max_pixels)


def _fragment_metadata(policy: FragmentPolicy) -> dict:
    return {FRAGMENT_BYTES_KEY: policy.target_bytes, FRAGMENT_ROWS_KEY: policy.max_rows}


def build_image_stage(partitions_def: dg.PartitionsDefinition) -> dg.AssetsDefinition:
    @dg.multi_asset(
        partitions_def=partitions_def,
        group_name="images",
        ins={RAW_IMAGES: dg.AssetIn(metadata={COLUMNS_KEY: RAW_COLUMNS})},
        outs={
            BUCKETED_IMAGES: dg.AssetOut(
                io_manager_key="lance_io_manager", kinds={"ray", "lance"}, code_version="2",
                metadata=_fragment_metadata(BUCKETED_FRAGMENTS),
                description="Every raw image filtered, bucketed to a tier and shape, resized "
                            "with Lanczos and stored as JPEG Q92; rejects keep their reason. "
                            "Incremental per row (raw sha256 and settings) and resumable."),
            PHASHES: dg.AssetOut(
                io_manager_key="lance_io_manager", kinds={"lance"}, code_version="2",
                metadata=_fragment_metadata(PHASH_FRAGMENTS),
                description="imagehash-compatible 64-bit DCT phash of each decodable original, "
                            "its pixel count, and whether it is flat (never a duplicate)."),
        },
    )
    def image_stage(context: dg.AssetExecutionContext, config: ImageStageConfig,
                    ray_cluster: RayResource, storage: StorageResource,
                    raw_images: ray.data.Dataset) -> Iterator[dg.MaterializeResult]:
        store, source = storage.get(), context.partition_key
        with asset_lease(context, store, BUCKETED_IMAGES):
            inputs = pin_inputs(store, source, RAW_IMAGES)
            raw = inputs[RAW_IMAGES]
            tables = ImageTables(store.table(BUCKETED_IMAGES, source), store.table(PHASHES, source),
                                 BUCKETED_FRAGMENTS, PHASH_FRAGMENTS)
            options = config.options()

            progress = StageProgress(f"{BUCKETED_IMAGES}[{source}]", None, context.log.info,
                                     unit="images")
            # The rows the IO manager loaded are read at the pinned version, as every input.
            report = run_image_stage(raw.read(columns=RAW_COLUMNS), raw, tables, options,
                                     config.chunk_rows,
                                     on_chunk=lambda r: progress.update(r.commits.rows,
                                                                        total=r.to_do))
            progress.total = report.to_do
            progress.finish()
            context.log.info(f"{source}: {report.written:,} image(s) processed, {report.removed:,} "
                             f"removed, settings {settings_fingerprint(options)}")
            # The Pillow build decides speed and (within 0.2 dB) pixels: the workers run this
            # environment's, so the driver's is the one that ran.
            backend = pil_backend.current()
            profile = bucket_profile(tables.bucketed)
            yield _result(context, store, BUCKETED_IMAGES, report, inputs,
                          processed=report.written, removed=report.removed,
                          compacted_from=report.commits.compacted_from,
                          metadata={**bucket_metadata(profile),
                                    **reject_sheet_metadata(tables.bucketed, raw,
                                                            profile.status_counts),
                                    "image_backend": backend.name,
                                    "image_backend_version": backend.version,
                                    "settings": settings_fingerprint(options),
                                    "chunks_committed": report.commits.commits,
                                    **duration_metadata("stage_seconds", report.seconds),
                                    **cost_metadata(report.seconds, report.written, 0,
                                                    DEFAULT_GPU_HOUR_USD,
                                                    config.cpu_hour_usd)})
            yield _result(context, store, PHASHES, report, inputs,
                          processed=report.hashes_written, removed=report.hashes_removed,
                          compacted_from=report.hashes_compacted_from,
                          metadata={"flat_images": profile.flat,
                                    "hashed_images": profile.hashed})

    return image_stage


def _result(context: dg.AssetExecutionContext, store: Storage, name: str,
            report: ImageRunReport, inputs: Inputs, processed: int, removed: int,
            compacted_from: int | None, metadata: dict) -> dg.MaterializeResult:
    """One table's materialisation: the IO manager's table entries, the incremental counts,
    and a data version that moves only when this run changed a row of it."""
    source = context.partition_key
    ref = store.table(name, source).pinned()
    write = describe_write(ref.open())
    write.nodes = sorted(report.nodes)
    write.compacted_from = compacted_from if compacted_from is not None else write.fragments
    return stage_result(
        context, inputs=inputs, lance_version=write.version, processed=processed,
        reused=max(0, write.rows - processed), removed=removed, asset=name,
        data_version=content_data_version(
            latest_data_version(context.instance, dg.AssetKey(name), source),
            changed=bool(processed or removed), lance_version=write.version),
        metadata={**table_metadata(ref, write), **metadata})


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
        reports = [r.stats() for r in fidelity_report(
            bucketed, raw, options, config.samples_per_band) if r.samples]
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
