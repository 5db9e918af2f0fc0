"""Turning table profiles into metadata the Dagster UI renders (tables, not prose)."""

from __future__ import annotations

from collections import Counter

import dagster as dg

from prx_assets.core.table_stats import TableProfile


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
