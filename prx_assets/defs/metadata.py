"""Turning table profiles into metadata the Dagster UI renders (tables, not prose)."""

from __future__ import annotations

from collections import Counter

import dagster as dg

from prx_assets.storage.table_stats import BucketProfile, TableProfile, bucket_profile, profile_table


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
    if profile.megapixel_bands:
        meta["megapixels"] = counts_table(profile.megapixel_bands, "megapixels")
        meta["aspect_ratios"] = counts_table(profile.aspect_bands, "width / height")
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
        "rejects_by_reason": counts_table(rejects, "reason", profile.rows),
        "images_per_tier": counts_table(Counter({str(t): n for t, n in profile.tier_counts.items()}),
                                        "tier", profile.kept),
        "images_per_shape": shapes,
    }


def _aspect(shape: str) -> float:
    w, h = shape.split("x")
    return int(w) / int(h)


def _raw_profile(uri: str) -> dict:
    return profile_metadata(profile_table(uri))


def _bucket_profile(uri: str) -> dict:
    return bucket_metadata(bucket_profile(uri))


# What the IO manager adds to an output's metadata, by the asset's `prx/profile` value.
PROFILERS = {"raw_images": _raw_profile, "bucketed_images": _bucket_profile}
