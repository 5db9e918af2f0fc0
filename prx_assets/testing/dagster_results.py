"""What a test reads back from an in-process Dagster run."""

from __future__ import annotations


def checks(result) -> dict:
    """`asset:check` -> passed, for every check the run evaluated."""
    return {f"{e.event_specific_data.asset_key.path[-1]}:{e.event_specific_data.check_name}":
            e.event_specific_data.passed
            for e in result.all_events if e.event_type_value == "ASSET_CHECK_EVALUATION"}
