"""Which Lance version of an upstream table a materialisation read (lineage per source)."""

from typing import Optional

import dagster as dg


def _latest_metadata(instance: dg.DagsterInstance, asset_key: dg.AssetKey,
                     partition_key: Optional[str], entry: str) -> Optional[int]:
    """An integer metadata entry of the latest materialisation of that partition."""
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=asset_key,
                              asset_partitions=[partition_key] if partition_key else None),
        limit=1,
    ).records
    if not records:
        return None
    value = records[0].asset_materialization.metadata.get(entry)
    return int(value.value) if value is not None else None


def materialized_lance_version(instance: dg.DagsterInstance, asset_key: dg.AssetKey,
                               partition_key: Optional[str]) -> Optional[int]:
    """The `lance_version` recorded by the latest materialisation of that partition."""
    return _latest_metadata(instance, asset_key, partition_key, "lance_version")


def input_versions(context: dg.AssetExecutionContext, *asset_names: str) -> dict:
    """Metadata entries `input_version/<asset>` for the partition being materialised."""
    partition = context.partition_key if context.has_partition_key else None
    return {
        f"input_version/{name}": materialized_lance_version(
            context.instance, dg.AssetKey(name), partition) or -1
        for name in asset_names
    }


def recorded_input_version(instance: dg.DagsterInstance, asset_key: dg.AssetKey,
                           partition_key: Optional[str], input_name: str) -> Optional[int]:
    """The `input_version/<input>` the latest materialisation of that partition recorded
    (-1, recorded when the input had no version, reads as None)."""
    version = _latest_metadata(instance, asset_key, partition_key, f"input_version/{input_name}")
    return version if version is not None and version >= 0 else None
