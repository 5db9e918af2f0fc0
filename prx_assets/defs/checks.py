"""Asset checks for the Lance tables (partitioned like their assets)."""


import dagster as dg


from prx_assets.core.lance_tables import FragmentPolicy, table_uri
from prx_assets.core.settings import data_root
from prx_assets.core.table_checks import duplicate_ids, fragment_health
from prx_assets.core.table_stats import profile_table
from prx_assets.defs.resources import RayResource


class RejectShareConfig(dg.Config):
    warn_above: float = 0.2


class FragmentConfig(dg.Config):
    target_mb: int = 512
    slack: int = 1


def table_checks(asset: dg.AssetsDefinition) -> list[dg.AssetChecksDefinition]:
    """ids unique, fragments healthy, reject share: for any per-source table with ids."""
    name = asset.key.path[-1]
    partitions_def = asset.partitions_def

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

    return [ids_unique, fragments_healthy, reject_share]


