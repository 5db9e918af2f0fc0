"""Small row lookups the browser's views share: one row by id, or the rows of a filter,
projected to the columns the table has and always limited."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prx_assets.storage.filters import eq_filter

if TYPE_CHECKING:
    from lance import LanceDataset


def one_row(table: LanceDataset | None, sample_id: str, columns: list[str],
            column: str = "id") -> dict | None:
    """The first row whose `column` equals `sample_id`, or None."""
    if table is None:
        return None
    present = [c for c in columns if c in table.schema.names]
    rows = table.to_table(columns=present, filter=eq_filter(column, sample_id), limit=1)
    return rows.to_pylist()[0] if rows.num_rows else None


def rows_where(table: LanceDataset | None, where: str, columns: list[str], limit: int = 100
               ) -> list[dict]:
    if table is None:
        return []
    present = [c for c in columns if c in table.schema.names]
    return table.to_table(columns=present, filter=where, limit=limit).to_pylist()
