"""Rows found by their key through the key index, for targets keyed on one column (raw and
bucketed images: `id`) or on several (captions: `id`, `caption_version`; labels and
attributes add their own version).

Lance's merge-insert looks a single key column up through a scalar index, but a key of
several columns it joins against every row of the table: one 1,024-row chunk into a
10⁶-row captions table read both key columns of all 10⁶ rows. A filter on the first key
column (`id IN (...)`) does go through its BTREE index, so the writer finds which rows a
chunk would replace itself (`rows_with_keys`), appends the rest, and merge-inserts only
those (`engine.chunked.upsert_looked_up`).
"""

from __future__ import annotations

import logging

import lance
import pyarrow as pa
import pyarrow.compute as pc

from prx_assets.storage.failpoints import failpoint
from prx_assets.storage.filters import in_filter
from prx_assets.storage.refs import TableRef

log = logging.getLogger(__name__)
KEY_SEPARATOR = "\x1f"  # joins a row's key columns into one string (a unit separator)


def key_strings(rows: pa.Table, keys: list[str]) -> pa.Array:
    """One value per row standing for its whole key: the key column itself for one key,
    the key columns joined as strings for several."""
    if len(keys) == 1:
        return rows.column(keys[0]).combine_chunks()
    parts = [pc.cast(rows.column(key), pa.string()) for key in keys]
    joined = pc.binary_join_element_wise(*parts, KEY_SEPARATOR, null_handling="replace",
                                         null_replacement="")
    return joined.combine_chunks() if isinstance(joined, pa.ChunkedArray) else joined


def rows_with_keys(dataset: lance.LanceDataset, rows: pa.Table, keys: list[str]) -> pa.Table:
    """The key columns and row address of every row of `dataset` holding one of `rows`'
    keys: looked up by the first key column (through its key index where the table has
    one), then matched on the whole key. Cost grows with `rows`, not with the table."""
    lookup = pc.unique(rows.column(keys[0])).to_pylist()
    found = dataset.to_table(columns=keys, filter=in_filter(keys[0], lookup),
                             with_row_address=True)
    if len(keys) == 1:
        return found
    return found.filter(pc.is_in(key_strings(found, keys), key_strings(rows, keys)))


def split_present(dataset: lance.LanceDataset, rows: pa.Table, keys: list[str]
                  ) -> tuple[pa.Table, pa.Table]:
    """`rows` whose key `dataset` holds (to be replaced), and the others (new)."""
    found = rows_with_keys(dataset, rows, keys)
    present = pc.is_in(key_strings(rows, keys), key_strings(found, keys))
    return rows.filter(present), rows.filter(pc.invert(present))


DROP_ATTEMPTS = 5  # deletes of later copies preempted by a compaction, then an error


def drop_later_copies(table: TableRef, keys: list[str], rows: pa.Table) -> int | None:
    """Delete every row holding one of `rows`' keys but the first (lowest row address: the
    earliest commit, so two writers repairing the same keys keep the same row). Returns the
    new version, None when no key had a copy. A lookup through the key index: cost grows
    with `rows`.

    The copies are found by key at one version and deleted by a commit made against that
    version: a row address names a row only within its version (a compaction moves rows),
    so when another commit (a compaction) lands in between, the delete conflicts and the
    copies are found again by key on the new version."""
    for attempt in range(1, DROP_ATTEMPTS + 1):
        dataset = table.latest().open()
        later = _later_copies(dataset, keys, rows)
        if not later:
            return None
        failpoint("storage.copies_found")
        try:
            version = _delete_at_version(table, dataset, later)
        except lance.commit.CommitConflictError:
            log.warning("%s: deleting later copies lost to a concurrent commit on version %d "
                        "(attempt %d of %d): finding them again by key", table,
                        dataset.version, attempt, DROP_ATTEMPTS)
            continue
        log.warning("%s: %d row(s) written twice by concurrent writers; kept the first copy",
                    table, len(later))
        return version
    raise RuntimeError(f"{table}: later copies of {len(rows)} key(s) not deleted: "
                       f"{DROP_ATTEMPTS} deletes lost to concurrent commits")


def _later_copies(dataset: lance.LanceDataset, keys: list[str], rows: pa.Table) -> list[int]:
    """Row addresses (in `dataset`'s version) of every copy of a key but its first."""
    found = rows_with_keys(dataset, rows, keys)
    if found.num_rows == 0:
        return []
    addresses = found.column("_rowaddr")
    by_key = pa.table({"key": key_strings(found, keys), "address": addresses})
    first = by_key.group_by("key").aggregate([("address", "min")]).column("address_min")
    return sorted(addresses.filter(pc.invert(pc.is_in(addresses, first))).to_pylist())


def _delete_at_version(table: TableRef, dataset: lance.LanceDataset, addresses: list[int]
                       ) -> int:
    """Delete the rows at `addresses` in one commit that lands only on `dataset`'s version
    (a later commit touching their fragments: CommitConflictError)."""
    by_fragment: dict[int, list[int]] = {}
    for address in addresses:
        by_fragment.setdefault(address >> 32, []).append(address)
    updated, removed = [], []
    for fragment_id, mine in by_fragment.items():
        fragment = dataset.get_fragment(fragment_id)
        assert fragment is not None  # an address read at this very version
        kept = fragment.delete(f"_rowaddr IN ({', '.join(map(str, mine))})")
        if kept is None:  # every row of the fragment was a later copy
            removed.append(fragment_id)
        else:
            updated.append(kept)
    operation = lance.LanceOperation.Delete(updated, removed, "later copies of keys")
    return lance.LanceDataset.commit(table.uri, operation, read_version=dataset.version,
                                     storage_options=table.lance_options()).version
