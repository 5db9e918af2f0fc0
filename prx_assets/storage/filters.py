"""Lance SQL filters built from values: the one place a value becomes a SQL literal.

Ids, caption versions, labels and source names come from outside the code (a source's file
names, a YAML config), so any of them can hold a single quote. Every filter that carries a
value is built here, where the quote is doubled, so such a value selects its own rows
instead of breaking the filter or widening it.
"""

from __future__ import annotations

from collections.abc import Iterable


def sql_string(value: str) -> str:
    """`value` as a Lance SQL string literal: quoted, with single quotes doubled."""
    return "'" + str(value).replace("'", "''") + "'"


def eq_filter(column: str, value: str) -> str:
    """Rows whose `column` equals `value`."""
    return f"{column} = {sql_string(value)}"


def in_filter(column: str, values: Iterable[str]) -> str:
    """Rows whose `column` is one of `values`; no values selects no rows (SQL has no empty
    `IN ()`)."""
    literals = [sql_string(value) for value in values]
    if not literals:
        return "FALSE"
    return f"{column} IN ({', '.join(literals)})"


def all_of(*conditions: str | None) -> str | None:
    """The conditions joined with AND, leaving out empty ones; None when none is left (a
    scan without a filter)."""
    return " AND ".join(c for c in conditions if c) or None
