"""Asset checks for the Lance tables (partitioned like their assets)."""


import dagster as dg


from prx_assets.s2_images.fidelity import fidelity_report
from prx_assets.s2_images.imaging import DEFAULT_QUALITY, DEFAULT_SUBSAMPLING, ImageOptions
from prx_assets.storage.lance_tables import FragmentPolicy, table_uri
from prx_assets.storage.settings import data_root
from prx_assets.storage.table_checks import duplicate_ids, fragment_health
from prx_assets.storage.table_stats import profile_table
from prx_assets.defs.resources import RayResource


class RejectShareConfig(dg.Config):
    warn_above: float = 0.2


class FragmentConfig(dg.Config):
    target_mb: int = 512
    slack: int = 1


def table_checks(asset: dg.AssetKey, partitions_def: dg.PartitionsDefinition,
                 with_reject_share: bool = True) -> list[dg.AssetChecksDefinition]:
    """ids unique, fragments healthy, reject share: for any per-source table with ids."""
    name = asset.path[-1]

    def uri_of(context: dg.AssetCheckExecutionContext) -> str:
        return str(table_uri(data_root(), name, context.partition_key))

    @dg.asset_check(asset=asset, name="ids_unique", partitions_def=partitions_def, blocking=True,
                    description="No sample id appears twice in the partition's table.")
    def ids_unique(context: dg.AssetCheckExecutionContext,
                   ray_cluster: RayResource) -> dg.AssetCheckResult:
        repeated, examples = duplicate_ids(uri_of(context))
        return dg.AssetCheckResult(passed=repeated == 0, metadata={
            "repeated_ids": repeated, "examples": ", ".join(examples) or "none"})

    @dg.asset_check(asset=asset, name="fragments_healthy", partitions_def=partitions_def,
                    description="Fragment count near what the byte target needs (few, large).")
    def fragments_healthy(context: dg.AssetCheckExecutionContext,
                          config: FragmentConfig) -> dg.AssetCheckResult:
        health = fragment_health(uri_of(context), FragmentPolicy(target_bytes=config.target_mb << 20),
                                 slack=config.slack)
        return dg.AssetCheckResult(passed=health.healthy, metadata={
            "fragments": health.fragments, "allowed": health.allowed,
            "mean_fragment_mb": round(health.mean_bytes / 1e6, 2), "rows": health.rows})

    @dg.asset_check(asset=asset, name="reject_share", partitions_def=partitions_def,
                    description="Share of rows whose status is not ok (warns above a bound).")
    def reject_share(context: dg.AssetCheckExecutionContext,
                     config: RejectShareConfig) -> dg.AssetCheckResult:
        profile = profile_table(uri_of(context))
        share = profile.not_ok_share
        return dg.AssetCheckResult(
            passed=share <= config.warn_above, severity=dg.AssetCheckSeverity.WARN,
            metadata={"reject_share": round(share, 4), "warn_above": config.warn_above,
                      "rows": profile.rows, "rejected": profile.rows - profile.ok_rows})

    return [ids_unique, fragments_healthy] + ([reject_share] if with_reject_share else [])


class FidelityConfig(dg.Config):
    samples_per_band: int = 16
    min_median_psnr_1x: float = 40.0
    min_median_psnr_10x: float = 38.0
    quality: int = DEFAULT_QUALITY
    subsampling: str = DEFAULT_SUBSAMPLING
    resize_mode: str = "crop"


def jpeg_fidelity_check(partitions_def: dg.PartitionsDefinition) -> dg.AssetChecksDefinition:
    @dg.asset_check(asset=dg.AssetKey("bucketed_images"), name="jpeg_fidelity",
                    partitions_def=partitions_def,
                    description="PSNR after 1 and 10 decode/encode cycles at Q92 on a fixed "
                                "sample, per resolution band, next to the published figures.")
    def jpeg_fidelity(context: dg.AssetCheckExecutionContext,
                      config: FidelityConfig) -> dg.AssetCheckResult:
        bucketed = str(table_uri(data_root(), "bucketed_images", context.partition_key))
        raw = str(table_uri(data_root(), "raw_images", context.partition_key))
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


