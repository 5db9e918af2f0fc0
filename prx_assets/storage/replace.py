"""Writes in two steps: the new rows first as uncommitted data files (`write_uncommitted`),
then one commit, so a reader sees the old rows or the new ones, never both, never neither.

`replace_where` commits one Lance `Update` that deletes the rows matching a filter and adds
the new ones (`corpus` replaces a source's rows this way); `overwrite_with` commits the
files as the table's whole new version (the MDS mapping, written group by group while a
tree builds and committed when the tree publishes)."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import lance
import pyarrow as pa
from lance.fragment import write_fragments

from prx_assets.storage.failpoints import failpoint
from prx_assets.storage.lance_tables import (
    UPSERT_ATTEMPTS,
    CommitConflictError,
    FragmentPolicy,
    fragment_sizes,
    prepare_output_dir,
)
from prx_assets.storage.refs import TableRef

log = logging.getLogger(__name__)


def write_uncommitted(table: TableRef, batches: Iterable[pa.RecordBatch | pa.Table],
                      schema: pa.Schema, policy: FragmentPolicy | None = None,
                      whole: bool = False) -> tuple[list[lance.FragmentMetadata], int]:
    """Write `batches` as data files of `table`, committing nothing; (fragments, rows).
    Streams: one batch is held at a time. A run killed before its commit leaves orphan
    files, which `cleanup` removes; the table is unchanged. `whole`: files of a whole new
    version (`overwrite_with`), whose schema may differ from the table's."""
    rows = 0

    def counted():
        nonlocal rows
        for batch in batches:
            for record_batch in (batch.cast(schema).to_batches()
                                 if isinstance(batch, pa.Table) else [batch.cast(schema)]):
                rows += record_batch.num_rows
                yield record_batch

    prepare_output_dir(table, "Lance table")
    fragments = write_fragments(pa.RecordBatchReader.from_batches(schema, counted()), table.uri,
                                schema=schema, mode="overwrite" if whole else "append",
                                storage_options=table.lance_options(),
                                **fragment_sizes(policy))
    return fragments, rows


def overwrite_with(table: TableRef, schema: pa.Schema,
                   fragments: list[lance.FragmentMetadata]) -> int:
    """The files `write_uncommitted(..., whole=True)` wrote as the table's whole new version,
    in one commit (created if absent); returns the version."""
    return lance.LanceDataset.commit(
        table.uri, lance.LanceOperation.Overwrite(schema, fragments),
        read_version=table.latest_version(), storage_options=table.lance_options()).version


def replace_where(table: TableRef, where: str, new_fragments: list[lance.FragmentMetadata]
                  ) -> tuple[int, int]:
    """In ONE commit, delete the rows matching `where` and add `new_fragments` (written by
    `write_uncommitted`); returns (version, rows deleted). A reader sees the old rows or the
    new ones, never both, never neither.

    Two replacements racing from one version must not both land: each would delete only
    the rows it saw, and the rows both add would be doubled. Lance rebases an Update over
    a concurrent one unless they touch a common fragment, so each replacement also names
    the table's first fragment, unchanged, among its updated fragments: one commit wins,
    the other is preempted and redoes its deletes against the winner's version (its new
    files are kept), up to `UPSERT_ATTEMPTS` times, then `CommitConflictError`."""
    table = table.latest()
    for attempt in range(1, UPSERT_ATTEMPTS + 1):
        dataset = table.open()
        operation, deleted = _replacement(dataset, where, new_fragments)
        failpoint("storage.replace_uncommitted")
        try:
            version = lance.LanceDataset.commit(
                table.uri, operation, read_version=dataset.version,
                storage_options=table.lance_options()).version
        except lance.commit.CommitConflictError as exc:
            log.warning("replacing rows of %s where %s lost its commit on version %d to a "
                        "concurrent writer (attempt %d of %d): deleting again on top (%s)",
                        table, where, dataset.version, attempt, UPSERT_ATTEMPTS,
                        str(exc).split(",")[0])
            continue
        return version, deleted
    raise CommitConflictError(
        f"replacing rows of {table} where {where}: lost the commit to concurrent writers "
        f"{UPSERT_ATTEMPTS} times; nothing was committed: rerun")


def _replacement(dataset: lance.LanceDataset, where: str,
                 new_fragments: list[lance.FragmentMetadata]
                 ) -> tuple[lance.LanceOperation.Update, int]:
    """The Update deleting `where` (deletion files written, uncommitted) and adding
    `new_fragments`, with the first fragment as the anchor two replacements conflict on."""
    fragments = dataset.get_fragments()
    if not fragments:
        raise ValueError(f"{dataset.uri}: a replacement needs a table with a fragment (write "
                         "an empty table whole instead)")
    updated: dict[int, lance.FragmentMetadata] = {}
    removed: list[int] = []
    deleted = 0
    for fragment in fragments:
        matching = fragment.count_rows(where)
        if not matching:
            continue
        deleted += matching
        remaining = fragment.delete(where)
        if remaining is None:
            removed.append(fragment.fragment_id)
        else:
            updated[fragment.fragment_id] = remaining
    anchor = fragments[0]
    if anchor.fragment_id not in updated and anchor.fragment_id not in removed:
        updated[anchor.fragment_id] = anchor.metadata  # as read: unchanged
    return lance.LanceOperation.Update(removed_fragment_ids=removed,
                                       updated_fragments=list(updated.values()),
                                       new_fragments=new_fragments), deleted
