"""Checks every per-source table gets: ids unique, fragments healthy, reject share."""

import dagster as dg

from prx_assets.defs.resources import RayResource, StorageResource
from prx_assets.storage.lance_tables import FragmentPolicy
from prx_assets.storage.table_checks import duplicate_ids, fragment_health
from prx_assets.storage.table_stats import profile_table


class RejectShareConfig(dg.Config):
    warn_above: float = 0.2


class FragmentConfig(dg.Config):
    target_mb: int = 512
    slack: int = 1


def table_checks(table: str, partitions_def: dg.PartitionsDefinition,
                 with_reject_share: bool = True) -> list[dg.AssetChecksDefinition]:
    """ids unique, fragments healthy, reject share: for any per-source table with ids
    (the asset and the table share their name)."""
    asset = dg.AssetKey(table)

    @dg.asset_check(asset=asset, name="ids_unique", partitions_def=partitions_def, blocking=True,
                    description="No sample id appears twice in the partition's table.")
    def ids_unique(context: dg.AssetCheckExecutionContext, ray_cluster: RayResource,
                   storage: StorageResource) -> dg.AssetCheckResult:
        store = storage.get()
        repeated, examples = duplicate_ids(store.table(table, context.partition_key))
        return dg.AssetCheckResult(passed=repeated == 0, metadata={
            "repeated_ids": repeated, "examples": ", ".join(examples) or "none"})

    @dg.asset_check(asset=asset, name="fragments_healthy", partitions_def=partitions_def,
                    description="Fragment count near what the byte target needs (few, large).")
    def fragments_healthy(context: dg.AssetCheckExecutionContext, config: FragmentConfig,
                          storage: StorageResource) -> dg.AssetCheckResult:
        store = storage.get()
        health = fragment_health(store.table(table, context.partition_key),
                                 FragmentPolicy(target_bytes=config.target_mb << 20),
                                 slack=config.slack)
        return dg.AssetCheckResult(passed=health.healthy, metadata={
            "fragments": health.fragments, "allowed": health.allowed,
            "mean_fragment_mb": round(health.mean_bytes / 1e6, 2), "rows": health.rows})

    @dg.asset_check(asset=asset, name="reject_share", partitions_def=partitions_def,
                    description="Share of rows whose status is not ok (warns above a bound).")
    def reject_share(context: dg.AssetCheckExecutionContext, config: RejectShareConfig,
                     storage: StorageResource) -> dg.AssetCheckResult:
        store = storage.get()
        profile = profile_table(store.table(table, context.partition_key))
        share = profile.not_ok_share
        return dg.AssetCheckResult(
            passed=share <= config.warn_above, severity=dg.AssetCheckSeverity.WARN,
            metadata={"reject_share": round(share, 4), "warn_above": config.warn_above,
                      "rows": profile.rows, "rejected": profile.rows - profile.ok_rows})

    return [ids_unique, fragments_healthy] + ([reject_share] if with_reject_share else [])
