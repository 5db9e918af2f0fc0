"""What a source's corpus rows need when its inputs changed: the rows as they should be now
(`expected`, without thumbnails) compared by id with the rows the corpus holds (`held`).

A row equal in every column stays as it is; a held row whose id left, or whose columns
changed, is deleted; an expected row that is new or changed is written. A written row whose
thumbnail was made from the same bytes (`made_from` equal: the bucketed image's raw sha256,
the image stage's settings and the thumbnail's size) carries the held thumbnail, read back
by row address, instead of decoding its image again. So a run that adds one image to a
source writes one row, and a new caption version rewrites rows without re-thumbnailing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

ROW_ADDRESS = "_rowaddr"  # Lance's row address column (`with_row_address=True`)


@dataclass(frozen=True)
class SourceDelta:
    """The rows to write (expected rows, no thumbnail), for each the held row address whose
    thumbnail it keeps (null: make a new one), and the ids of held rows to delete."""

    write: pa.Table
    carried: pa.Array
    delete: pa.Array

    @property
    def empty(self) -> bool:
        return self.write.num_rows == 0 and len(self.delete) == 0

    def with_thumbnail_kept(self) -> pa.Table:
        """The rows to write that keep a held thumbnail, sorted by its row address (the
        order Lance reads them back in), with the address as ROW_ADDRESS."""
        kept = pc.is_valid(self.carried)
        rows = self.write.filter(kept).append_column(ROW_ADDRESS, self.carried.filter(kept))
        return rows.sort_by(ROW_ADDRESS)

    def needing_thumbnail(self) -> pa.Table:
        return self.write.filter(pc.is_null(self.carried))


def plan_delta(expected: pa.Table, held: pa.Table, rewrite_all: bool = False) -> SourceDelta:
    """Compare `expected` with `held` (the same columns, plus ROW_ADDRESS) by id.
    `rewrite_all`: every expected row is written and every held row deleted (a whole
    source replaced), thumbnails still carried where `made_from` is unchanged."""
    ids = expected.column("id")
    at = pc.index_in(ids, value_set=held.column("id"))
    matched = held.take(at)  # a null row where the id is not held
    same = np.zeros(expected.num_rows, dtype=bool) if rewrite_all else \
        pc.is_valid(at).to_numpy(zero_copy_only=False) & rows_equal(expected, matched)
    changed = pa.array(~same)
    write = expected.filter(changed)
    previous = matched.filter(changed)
    thumbnail_kept = columns_equal(write.column("made_from"), previous.column("made_from")) \
        & pc.is_valid(write.column("made_from")).to_numpy(zero_copy_only=False)
    carried = pc.if_else(pa.array(thumbnail_kept), previous.column(ROW_ADDRESS).combine_chunks(),
                         pa.nulls(write.num_rows, pa.uint64()))
    unchanged_ids = ids.filter(pa.array(same))
    held_ids = held.column("id")
    delete = held_ids.filter(pc.invert(pc.is_in(held_ids, value_set=unchanged_ids)))
    return SourceDelta(write, carried.cast(pa.uint64()), delete.combine_chunks())


def rows_equal(a: pa.Table, b: pa.Table) -> np.ndarray:
    """Per row, whether every column of `a` equals the same column of `b` (nulls equal)."""
    same = np.ones(a.num_rows, dtype=bool)
    for name in a.column_names:
        same &= columns_equal(a.column(name), b.column(name))
    return same


def columns_equal(a: pa.ChunkedArray | pa.Array, b: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """Per row, a == b, two nulls counting as equal; fixed-size lists (embeddings) compared
    element by element."""
    a, b = _combined(a), _combined(b)
    a_null = pc.is_null(a).to_numpy(zero_copy_only=False)
    b_null = pc.is_null(b).to_numpy(zero_copy_only=False)
    if pa.types.is_fixed_size_list(a.type):
        values = _fixed_size_values(a) == _fixed_size_values(b)
        equal = values.all(axis=1) if values.size else np.ones(len(a), dtype=bool)
    elif pa.types.is_list(a.type) or pa.types.is_large_list(a.type):
        equal = _lists_equal(a, b)
    else:
        equal = pc.fill_null(pc.equal(a, b), False).to_numpy(zero_copy_only=False)
    return np.where(a_null | b_null, a_null & b_null, equal)


def _lists_equal(a: pa.Array, b: pa.Array) -> np.ndarray:
    """Per row, lists of the same length with equal elements (nulls aside: the caller's)."""
    lengths_a = pc.fill_null(pc.list_value_length(a), 0).to_numpy(zero_copy_only=False)
    lengths_b = pc.fill_null(pc.list_value_length(b), 0).to_numpy(zero_copy_only=False)
    equal = lengths_a == lengths_b
    rows = np.flatnonzero(equal)
    same_length = pa.array(rows)
    # Rows of equal length flatten to aligned elements: compare those, and fail each row
    # holding an element that differs.
    elements_a = pc.list_flatten(a.take(same_length))
    elements_b = pc.list_flatten(b.take(same_length))
    differing = ~columns_equal(elements_a, elements_b)
    parents = pc.list_parent_indices(a.take(same_length)).to_numpy(zero_copy_only=False)
    equal[rows[np.unique(parents[differing])]] = False
    return equal


def _combined(column: pa.ChunkedArray | pa.Array) -> pa.Array:
    return column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column


def _fixed_size_values(array: pa.FixedSizeListArray) -> np.ndarray:
    """The list values as a (rows, size) array (null rows hold whatever their slots hold)."""
    size = array.type.list_size
    values = array.values.slice(array.offset * size, len(array) * size)
    return values.to_numpy(zero_copy_only=False).reshape(len(array), size)
