"""The funnel now lives in `prx_assets.stages.report.funnel` (the Dagster assets use it too,
and `defs` must not import the demo); kept so older imports of the demo module still work."""

from prx_assets.stages.report.funnel import (
    DECODED_STATUSES,
    Funnel,
    format_funnel,
    skipped_in_tree,
    source_funnel,
)

__all__ = ["DECODED_STATUSES", "Funnel", "format_funnel", "skipped_in_tree", "source_funnel"]
