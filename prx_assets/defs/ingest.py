"""raw_images: every configured source ingested into Lance, one partition per source,
incrementally: a rerun reads only the units that changed and deletes the rows that left
(`stages.ingest.ingest`), committing chunk by chunk through the shared runner."""

import dagster as dg

from prx_assets.defs.asset_leases import asset_lease
from prx_assets.defs.io_managers import FRAGMENT_BYTES_KEY, PROFILE_KEY, table_metadata
from prx_assets.defs.metadata import (
    content_data_version,
    latest_data_version,
    stage_result,
)
from prx_assets.defs.per_source_checks import table_checks
from prx_assets.defs.resources import RayResource, SourcesResource, StorageResource
from prx_assets.engine.chunked import CommitTarget
from prx_assets.engine.progress import StageProgress
from prx_assets.stages.ingest.ingest import (
    IngestOptions,
    IngestReport,
    ingest_source,
)
from prx_assets.stages.ingest.listing import ListingError, SourceNotFoundError
from prx_assets.stages.ingest.probe import DEFAULT_MAX_PIXELS
from prx_assets.stages.ingest.raw_rows import DEFAULT_MAX_CAPTION_BYTES, RAW_IMAGES_SCHEMA
from prx_assets.stages.ingest.readers import DEFAULT_MAX_FILE_BYTES
from prx_assets.stages.ingest.removals import RemovalLimitError
from prx_assets.stages.opt_outs.rights import reservation_counts
from prx_assets.storage.lance_tables import FragmentPolicy, WriteReport, describe_write
from prx_assets.storage.object_store import ObjectStoreError
from prx_assets.storage.retention import blob_grace
from prx_assets.storage.tables import RAW_IMAGES

# Image-blob fragments, sized by bytes (docs/architecture.md, fragment hygiene).
FRAGMENT_BYTES = 512 << 20


class IngestConfig(dg.Config):
    max_pixels: int = DEFAULT_MAX_PIXELS
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    max_caption_bytes: int = DEFAULT_MAX_CAPTION_BYTES  # a longer caption is cut, with a note
    files_per_task: int = 64
    chunk_rows: int = 1024  # rows per commit: a kill loses at most one chunk of work
    # The largest share of the source's rows one run may remove (1.0: any); past it the run
    # fails and removes nothing (docs/factory.md, "Listings that fail").
    max_removed_share: float = 0.10
    removal_floor_rows: int = 100  # a run may always remove this many rows


def build_raw_images(partitions_def: dg.PartitionsDefinition) -> dg.AssetsDefinition:
    @dg.asset(
        name=RAW_IMAGES,
        partitions_def=partitions_def,
        # Downstream assets load this table through the IO manager (pinned to the
        # `lance_version` recorded here); the asset writes it itself.
        io_manager_key="lance_io_manager",
        group_name="ingest",
        kinds={"ray", "lance"},
        code_version="2",
        metadata={FRAGMENT_BYTES_KEY: FRAGMENT_BYTES, PROFILE_KEY: RAW_IMAGES},
        description="Original image bytes of one source, with header size, format, sha256, "
                    "original caption and a status per item (ok or the reason it is unusable). "
                    "Incremental: only new or changed items are read, removed ones deleted.",
    )
    def raw_images(context: dg.AssetExecutionContext, config: IngestConfig,
                   ray_cluster: RayResource, sources: SourcesResource,
                   storage: StorageResource) -> dg.MaterializeResult:
        catalog = sources.load()
        spec = catalog.get(context.partition_key)
        uri = catalog.location_of(spec.name)
        store = storage.get()
        with asset_lease(context, store):
            target = CommitTarget(store.table(RAW_IMAGES, spec.name), RAW_IMAGES_SCHEMA, ["id"],
                                  FragmentPolicy(target_bytes=FRAGMENT_BYTES,
                                                 superseded_grace=blob_grace()))
            options = IngestOptions(max_pixels=config.max_pixels,
                                    max_file_bytes=config.max_file_bytes,
                                    max_caption_bytes=config.max_caption_bytes,
                                    units_per_task=config.files_per_task,
                                    chunk_rows=config.chunk_rows,
                                    max_removed_share=config.max_removed_share,
                                    removal_floor_rows=config.removal_floor_rows)
            context.log.info(f"ingesting source {spec.name!r} ({spec.kind}) from {uri}")
            try:
                store.check_reachable()
                # Rows per unit are known only once read: the line counts rows, without a total
                # (the listing's line before it says how many units are left to read).
                progress = StageProgress(f"{RAW_IMAGES}[{spec.name}]", None, context.log.info)
                report = ingest_source(spec, uri, target, options,
                                       on_chunk=lambda _chunk, run: progress.update(run.rows),
                                       log=context.log.info)
                progress.finish()
            except (SourceNotFoundError, ObjectStoreError, ListingError,
                    RemovalLimitError) as exc:
                raise dg.Failure(f"source {spec.name!r}: {exc}") from exc
            context.log.info(
                f"{spec.name}: {report.rows_processed:,} row(s) read from {report.units_read:,} "
                f"unit(s), {report.rows_reused:,} reused from the last run, "
                f"{report.rows_removed:,} removed; "
                f"version {report.lance_version}")
            return _result(context, target, report, spec.kind, uri, spec.license)

    return raw_images


def _result(context: dg.AssetExecutionContext, target: CommitTarget,
            report: IngestReport, kind: str, uri: str, license: str) -> dg.MaterializeResult:
    """The run as Dagster records it: raw_images reads no table (no lineage), the source."""
    written = describe_write(target.open())
    written.nodes = sorted(report.nodes)
    written.compacted_from = report.commits.compacted_from or written.fragments
    return stage_result(
        context, inputs={}, lance_version=written.version, processed=report.rows_processed,
        reused=report.rows_reused, removed=report.rows_removed,
        data_version=content_data_version(
            latest_data_version(context.instance, context.asset_key, context.partition_key),
            report.changed, report.lance_version),
        metadata=_metadata(target, written, report, kind, uri, license))


def _metadata(target: CommitTarget, written: WriteReport, report: IngestReport, kind: str,
              uri: str, license: str) -> dict:
    return {
        **table_metadata(target.table, written, RAW_IMAGES),
        "units_listed": report.units_listed,
        "units_read": report.units_read,
        "commits": report.commits.commits,
        **({"rebuilt_because": report.rebuilt_because} if report.rebuilt_because else {}),
        "source_kind": kind,
        "source_uri": dg.MetadataValue.path(uri),
        "license": license,
        # Rows by training reservation (docs/rights.md): one string column read.
        "reservations": dg.MetadataValue.json(reservation_counts(target.table)),
    }


def ingest_defs(partitions_def: dg.PartitionsDefinition) -> dg.Definitions:
    return dg.Definitions(assets=[build_raw_images(partitions_def)],
                          asset_checks=table_checks(RAW_IMAGES, partitions_def))
