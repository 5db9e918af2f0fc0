"""Asset metadata: reading back what materialisations recorded (lineage per source) and
turning table profiles into what the Dagster UI renders (tables, not prose)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import dagster as dg

from prx_assets.browser.links import view_url
from prx_assets.defs.report import (
    bands_chart,
    duration_metadata,
    size_in_words,
    tier_shape_matrix,
)
from prx_assets.stages.report.charts import percent
from prx_assets.storage.layout import Storage
from prx_assets.storage.refs import TableRef
from prx_assets.storage.table_stats import (
    AR_BANDS,
    MP_BANDS,
    BucketProfile,
    TableProfile,
    band_label,
    bucket_profile,
    profile_table,
)
from prx_assets.storage.tables import BUCKETED_IMAGES, RAW_IMAGES

# ------------------------------------------------------------------ reading what was recorded

def latest_materialization(instance: dg.DagsterInstance, asset_key: dg.AssetKey | str,
                           partition_key: str | None) -> dg.AssetMaterialization | None:
    """The latest materialisation of that asset partition (None if it never ran)."""
    key = dg.AssetKey(asset_key) if isinstance(asset_key, str) else asset_key
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=key,
                              asset_partitions=[partition_key] if partition_key else None),
        limit=1,
    ).records
    return records[0].asset_materialization if records else None


def recorded(materialization: dg.AssetMaterialization | None, entry: str) -> Any:
    """The raw value of one metadata entry of a materialisation, None if absent."""
    if materialization is None:
        return None
    value = materialization.metadata.get(entry)
    return value.value if value is not None else None


def latest_recorded(instance: dg.DagsterInstance, asset_key: dg.AssetKey | str,
                    partition_key: str | None, entry: str) -> Any:
    """One metadata entry of the latest materialisation of that partition."""
    return recorded(latest_materialization(instance, asset_key, partition_key), entry)


def materialized_lance_version(instance: dg.DagsterInstance, asset_key: dg.AssetKey | str,
                               partition_key: str | None) -> int | None:
    """The `lance_version` recorded by the latest materialisation of that partition."""
    value = latest_recorded(instance, asset_key, partition_key, "lance_version")
    return int(value) if value is not None else None


def recorded_input_version(instance: dg.DagsterInstance, asset_key: dg.AssetKey | str,
                           partition_key: str | None, input_name: str) -> int | None:
    """The `input_version/<input>` the latest materialisation of that partition recorded
    (-1, recorded when the input had no version, reads as None)."""
    version = latest_recorded(instance, asset_key, partition_key, f"input_version/{input_name}")
    return int(version) if version is not None and int(version) >= 0 else None


# ------------------------------------------------------------------ rendering for the UI

def counts_table(counts: Counter, key_name: str, total: int | None = None) -> dg.TableMetadataValue:
    total = total if total is not None else sum(counts.values())
    records = [
        dg.TableRecord({key_name: str(key), "count": int(n),
                        "share": round(n / total, 4) if total else 0.0})
        for key, n in sorted(counts.items(), key=lambda kv: (-kv[1], str(kv[0])))
    ]
    schema = dg.TableSchema(columns=[
        dg.TableColumn(key_name, "string"), dg.TableColumn("count", "int"),
        dg.TableColumn("share", "float"),
    ])
    return dg.MetadataValue.table(records, schema=schema)


def profile_metadata(profile: TableProfile) -> dict:
    rejects = Counter({k: v for k, v in profile.status_counts.items() if k != "ok"})
    meta: dict = {
        "ok_rows": profile.ok_rows,
        "rejected_rows": sum(rejects.values()),
        "rejects_by_reason": counts_table(rejects, "reason", profile.rows),
    }
    if profile.format_counts:
        meta["formats"] = counts_table(profile.format_counts, "format")
        meta["image_mb"] = round(profile.image_bytes / 1e6, 2)
        meta["image_size"] = size_in_words(profile.image_bytes)
    if profile.megapixel_bands:
        meta["megapixels"] = counts_table(profile.megapixel_bands, "megapixels")
        meta["aspect_ratios"] = counts_table(profile.aspect_bands, "width / height")
        meta["megapixels_chart"] = bands_chart(
            dict(profile.megapixel_bands), "decodable images by megapixels",
            [band_label((lo + min(hi, 1e9)) / 2, MP_BANDS, " MP") for lo, hi in MP_BANDS])
        meta["aspect_ratios_chart"] = bands_chart(
            dict(profile.aspect_bands), "decodable images by width / height",
            [band_label((lo + min(hi, 1e9)) / 2, AR_BANDS) for lo, hi in AR_BANDS])
    return meta


def bucket_metadata(profile: BucketProfile) -> dict:
    rejects = Counter({k: v for k, v in profile.status_counts.items() if k != "ok"})
    shape_records = [
        dg.TableRecord({"tier": int(tier), "shape": shape, "count": int(n)})
        for (tier, shape), n in sorted(profile.shape_counts.items(),
                                       key=lambda kv: (kv[0][0], _aspect(kv[0][1])))
    ]
    shapes = dg.MetadataValue.table(shape_records, schema=dg.TableSchema(columns=[
        dg.TableColumn("tier", "int"), dg.TableColumn("shape", "string"),
        dg.TableColumn("count", "int")]))
    return {
        "kept": profile.kept,
        "kept_share": round(profile.kept_share, 4),
        "kept_share_in_words": f"{percent(profile.kept_share)} ({profile.kept:,} of "
                               f"{profile.rows:,})",
        "tier_by_shape": tier_shape_matrix(
            {(int(tier), shape): int(n) for (tier, shape), n in profile.shape_counts.items()}),
        "rejects_by_reason": counts_table(rejects, "reason", profile.rows),
        "images_per_tier": counts_table(
            Counter({str(t): n for t, n in profile.tier_counts.items()}), "tier", profile.kept),
        "images_per_shape": shapes,
    }


def _aspect(shape: str) -> float:
    w, h = shape.split("x")
    return int(w) / int(h)


def _raw_profile(table: TableRef) -> dict:
    return profile_metadata(profile_table(table))


def _bucket_profile(table: TableRef) -> dict:
    return bucket_metadata(bucket_profile(table))


# What the IO manager adds to an output's metadata, by the asset's `prx/profile` value.
PROFILERS = {RAW_IMAGES: _raw_profile, BUCKETED_IMAGES: _bucket_profile}


def browser_link(context: dg.AssetExecutionContext | dg.OutputContext,
                 asset: str | None = None) -> dict:
    """`browser`: the corpus browser's view of this asset (partition) when PRX_BROWSER_URL
    says where `prx-assets browse` serves; nothing otherwise. `asset` names one asset of
    a multi-asset (whose context has no single asset key)."""
    partition = context.partition_key if context.has_partition_key else None
    url = view_url(asset or context.asset_key.path[-1], partition)
    return {"browser": dg.MetadataValue.url(url)} if url else {}


# ------------------------------------------------------------------ incremental runs

# Contract keys (design.md, "incremental metadata"): other tools read these exact names.
ROWS_PROCESSED = "rows_processed"  # rows whose work ran in this run
ROWS_REUSED = "rows_reused"  # rows carried over unchanged
ROWS_REMOVED = "rows_removed"  # rows that left the partition


def incremental_metadata(processed: int, reused: int, removed: int) -> dict[str, int]:
    """The three counts every per-source stage reports, under the contract's names."""
    return {ROWS_PROCESSED: int(processed), ROWS_REUSED: int(reused),
            ROWS_REMOVED: int(removed)}


def content_data_version(previous: str | None, changed: bool, lance_version: int | None,
                         table_uuid: str = "") -> dg.DataVersion:
    """The partition's Dagster data version: unchanged when this run changed no row (so
    downstream partitions stay fresh in the UI), else a new one naming the table version
    the change produced. `table_uuid` tells a recreated table's version 1 from the old one's.
    """
    if not changed and previous:
        return dg.DataVersion(previous)
    return dg.DataVersion(f"lance-{table_uuid}{'-' if table_uuid else ''}v{lance_version}")


def latest_data_version(instance: dg.DagsterInstance, asset_key: dg.AssetKey | str,
                        partition_key: str | None) -> str | None:
    """The data version the latest materialisation of that partition recorded."""
    materialization = latest_materialization(instance, asset_key, partition_key)
    if materialization is None:
        return None
    return materialization.tags.get("dagster/data_version") if materialization.tags else None


# ------------------------------------------------------------------ a stage's run, recorded

INPUT_VERSION = "input_version/"  # lineage entries: `input_version/<input>` -> version read


def input_lineage(versions: Mapping[str, int | None]) -> dict[str, int]:
    """`input_version/<input>` entries: the version each input was read at (-1: none)."""
    return {f"{INPUT_VERSION}{name}": -1 if version is None else int(version)
            for name, version in versions.items()}


@dataclass(frozen=True)
class Inputs:
    """A run's input tables, each pinned at the version the run reads."""

    tables: dict[str, TableRef]

    def __getitem__(self, name: str) -> TableRef:
        return self.tables[name]

    def versions(self) -> dict[str, int | None]:
        return {name: table.version for name, table in self.tables.items()}


def pin_inputs(store: Storage, source: str | None, *names: str) -> Inputs:
    """Each input table of a run pinned at its latest version as the run starts (an absent
    table stays unpinned: version None, recorded as -1).

    The one way inputs are pinned. Not the materialised version: a per-source stage commits
    chunk by chunk, so a killed upstream run leaves committed rows no materialisation names,
    and tables written outside Dagster (the CLI, tests) have none at all; the latest version
    always exists and holds every committed row (each row is keyed, so reading a chunk again
    never doubles it). Pinned once, what the run reads and the `input_version/*` it records
    are one version, whatever commits upstream while it runs."""
    tables = {name: store.table(name, source) for name in names}
    return Inputs({name: table.pinned() if table.exists() else table
                   for name, table in tables.items()})


def stage_result(context: dg.AssetExecutionContext, *, inputs: Inputs | Mapping[str, int | None],
                 lance_version: int | None, processed: int, reused: int, removed: int,
                 seconds: float | None = None, data_version: dg.DataVersion | None = None,
                 asset: str | None = None, metadata: Mapping[str, Any] | None = None
                 ) -> dg.MaterializeResult:
    """A stage's run as Dagster records it: lineage (`input_version/<input>`), the browser's
    link, the table's `lance_version`, the incremental counts under the contract's names,
    the run's duration (`stage_seconds`), then the stage's own entries; `asset` names one
    output of a multi-asset."""
    versions = inputs.versions() if isinstance(inputs, Inputs) else inputs
    entries: dict[str, Any] = {**input_lineage(versions), **browser_link(context, asset),
                               "lance_version": lance_version,
                               **incremental_metadata(processed, reused, removed)}
    if seconds is not None:
        entries.update(duration_metadata("stage_seconds", seconds))
    return dg.MaterializeResult(asset_key=dg.AssetKey(asset) if asset else None,
                                data_version=data_version,
                                metadata={**entries, **(metadata or {})})
