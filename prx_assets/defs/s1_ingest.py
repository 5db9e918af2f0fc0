"""raw_images: every configured source ingested into Lance, one partition per source."""

from pathlib import Path

import dagster as dg

from prx_assets.s1_ingest.ingest import IngestOptions, build_raw_dataset
from prx_assets.s1_ingest.probe import DEFAULT_MAX_PIXELS
from prx_assets.s1_ingest.raw_rows import RAW_IMAGES_SCHEMA
from prx_assets.s1_ingest.readers import DEFAULT_MAX_FILE_BYTES, SourceNotFoundError
from prx_assets.storage.tables import RAW_IMAGES
from prx_assets.defs.io_managers import FRAGMENT_BYTES_KEY, PROFILE_KEY, LanceTableOutput
from prx_assets.defs.resources import RayResource, SourcesResource, StorageResource
from prx_assets.defs.table_checks import table_checks


class IngestConfig(dg.Config):
    max_pixels: int = DEFAULT_MAX_PIXELS
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    files_per_task: int = 64


def build_raw_images(partitions_def: dg.PartitionsDefinition) -> dg.AssetsDefinition:
    @dg.asset(
        name=RAW_IMAGES,
        partitions_def=partitions_def,
        io_manager_key="lance_io_manager",
        group_name="ingest",
        kinds={"ray", "lance"},
        code_version="1",
        metadata={FRAGMENT_BYTES_KEY: 512 << 20, PROFILE_KEY: RAW_IMAGES},
        description="Original image bytes of one source, with header size, format, sha256, "
                    "original caption and a status per item (ok or the reason it is unusable).",
    )
    def raw_images(context: dg.AssetExecutionContext, config: IngestConfig, ray_cluster: RayResource,
                   sources: SourcesResource, storage: StorageResource) -> LanceTableOutput:
        catalog = sources.load()
        spec = catalog.get(context.partition_key)
        uri = catalog.uri_of(spec.name)
        # Per run, so two runs of one source never share a manifest; the IO manager removes it.
        work_dir = Path(storage.get().work_dir(RAW_IMAGES, spec.name, context.run.run_id))
        try:
            dataset = build_raw_dataset(
                spec, uri, work_dir,
                IngestOptions(config.max_pixels, config.max_file_bytes, config.files_per_task),
            )
        except SourceNotFoundError as exc:
            raise dg.Failure(str(exc)) from exc
        context.log.info(f"ingesting source {spec.name!r} ({spec.kind}) from {uri}")
        return LanceTableOutput(dataset, RAW_IMAGES_SCHEMA, scratch=work_dir, metadata={
            "source_kind": spec.kind, "source_uri": dg.MetadataValue.path(str(uri)),
            "license": spec.license,
        })

    return raw_images


def ingest_defs(partitions_def: dg.PartitionsDefinition) -> dg.Definitions:
    return dg.Definitions(assets=[build_raw_images(partitions_def)],
                          asset_checks=table_checks(RAW_IMAGES, partitions_def))
