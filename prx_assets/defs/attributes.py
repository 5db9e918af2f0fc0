"""attributes: one structured record per kept image and source, in the `gpu` pool, versioned
and incremental like captions, with its checks.

The default backend derives what it can from the caption on the CPU (records marked
`caption_derived`); `vllm` runs the captioning VLM with structured-output decoding."""


from collections import Counter

import dagster as dg

from prx_assets.defs.captions import GPU_POOL
from prx_assets.defs.leases import asset_lease
from prx_assets.defs.metadata import browser_link, counts_table, incremental_metadata
from prx_assets.defs.report import duration_metadata
from prx_assets.engine.progress import StageProgress
from prx_assets.stages.attributes.backends import VLLMAttributeSettings
from prx_assets.stages.attributes.runs import (
    AttributerSpec,
    attribute_coverage,
    tag_source,
)
from prx_assets.stages.attributes.schema import SCHEMA_VERSION
from prx_assets.stages.captions.captions import active_caption_filter
from prx_assets.storage.tables import ATTRIBUTES, BUCKETED_IMAGES, CAPTIONS


class AttributerResource(dg.ConfigurableResource):
    """Which backend tags attributes: `caption` (the CPU default, MiniLM zero-shot over the
    caption), `transformers` (local weights, structured decoding) or `vllm` (the captioning
    VLM through ray.data.llm with a JSON-schema structured output)."""

    backend: str = "caption"
    model: str = ""  # transformers: a local folder; vllm: a HF id (default Qwen3-VL-8B)
    schema_version: str = SCHEMA_VERSION
    batch_size: int = 32
    actors: int = 1
    threads_per_actor: int = 1
    vllm_concurrency: int = 1
    vllm_retries: int = 2
    chunk_rows: int = 1024  # rows committed per Lance merge-insert

    def spec(self) -> AttributerSpec:
        vllm = VLLMAttributeSettings(model=self.model or VLLMAttributeSettings.model,
                                     concurrency=self.vllm_concurrency,
                                     batch_size=self.batch_size, retries=self.vllm_retries)
        return AttributerSpec(backend=self.backend, model=self.model,
                              schema_version=self.schema_version, batch_size=self.batch_size,
                              actors=self.actors, threads_per_actor=self.threads_per_actor,
                              vllm=vllm)

    def attribute_version(self) -> str:
        return self.spec().version()


def build_attributes(partitions_def: dg.PartitionsDefinition) -> dg.AssetsDefinition:
    @dg.asset(
        name=ATTRIBUTES, partitions_def=partitions_def, group_name="captions",
        deps=[CAPTIONS, BUCKETED_IMAGES], kinds={"ray", "lance"}, pool=GPU_POOL,
        code_version=SCHEMA_VERSION,
        required_resource_keys={"captioner", "attributer", "ray_cluster", "storage"},
        description="One structured attribute record per kept image (medium, subjects, "
                    "people, visible text, watermark, setting, lighting, composition, style, "
                    "technical and aesthetic quality) against a versioned JSON schema; typed "
                    "Lance columns; incremental per (caption, attribute) version.")
    def attributes(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        attributer: AttributerResource = context.resources.attributer
        spec = attributer.spec()
        source = context.partition_key
        caption_version = context.resources.captioner.caption_version()
        store = context.resources.storage.get()
        captions, table = store.table(CAPTIONS, source), store.table(ATTRIBUTES, source)
        bucketed = store.table(BUCKETED_IMAGES, source)
        # Captions commit chunks outside materialisations: pin once, tag it, record it.
        captions_version = captions.latest_version()
        bucketed_version = bucketed.latest_version() if bucketed.exists() else None
        caption_filter = active_caption_filter(caption_version)
        progress = StageProgress(f"{ATTRIBUTES}[{source}]", None, context.log.info,
                                 unit="images")
        with asset_lease(context, store):
            report = tag_source(captions.at(captions_version), table, caption_version,
                                caption_filter, spec,
                                bucketed.at(bucketed_version) if bucketed_version else None,
                                attributer.chunk_rows,
                                lambda r: progress.update(r.commits.rows, total=r.to_tag))
        progress.total = report.to_tag
        progress.finish()
        cover = attribute_coverage(captions, table, caption_filter, caption_version,
                                   report.attribute_version)
        return dg.MaterializeResult(
            data_version=dg.DataVersion(
                f"{caption_version}/{report.attribute_version}@{report.lance_version}"),
            metadata={
                f"input_version/{CAPTIONS}": -1 if captions_version is None
                else captions_version,
                f"input_version/{BUCKETED_IMAGES}": -1 if bucketed_version is None
                else bucketed_version,
                **browser_link(context),
                "lance_version": report.lance_version,
                "caption_version": caption_version,
                "attribute_version": report.attribute_version,
                "schema_version": spec.schema_version,
                "backend": spec.backend, "model": spec.model_name, "origin": spec.origin,
                **incremental_metadata(report.written,
                                       max(0, cover.recorded - report.written), 0),
                "records_by_status": counts_table(Counter(cover.statuses), "status"),
                "valid_share": round(cover.share, 4),
                "reasons": "; ".join(report.reasons) or "none",
                **duration_metadata("stage_seconds", report.seconds),
                "dagster/row_count": cover.recorded,
            })

    return attributes


class AttributeCheckConfig(dg.Config):
    min_recorded_share: float = 1.0  # usable captions with a record (valid or with a reason)


def attribute_checks(partitions_def: dg.PartitionsDefinition
                     ) -> list[dg.AssetChecksDefinition]:
    @dg.asset_check(asset=dg.AssetKey(ATTRIBUTES), name="every_image_recorded",
                    partitions_def=partitions_def,
                    required_resource_keys={"captioner", "attributer", "storage"},
                    description="Every usable caption of the active version has a record "
                                "under the active attribute version: valid, or recorded "
                                "with the reason it is not (structured-decoding validity).")
    def every_image_recorded(context: dg.AssetCheckExecutionContext,
                             config: AttributeCheckConfig) -> dg.AssetCheckResult:
        version = context.resources.captioner.caption_version()
        source, store = context.partition_key, context.resources.storage.get()
        cover = attribute_coverage(store.table(CAPTIONS, source),
                                   store.table(ATTRIBUTES, source),
                                   active_caption_filter(version), version,
                                   context.resources.attributer.attribute_version())
        final = cover.valid + cover.statuses.get("invalid", 0)
        share = final / cover.captions if cover.captions else 1.0
        return dg.AssetCheckResult(passed=share >= config.min_recorded_share, metadata={
            "recorded_share": round(share, 4), "valid": cover.valid,
            "invalid_with_reason": cover.statuses.get("invalid", 0),
            "failed": cover.statuses.get("failed", 0), "captions": cover.captions})

    return [every_image_recorded]


def attribute_defs(partitions_def: dg.PartitionsDefinition) -> dg.Definitions:
    return dg.Definitions(assets=[build_attributes(partitions_def)],
                          asset_checks=attribute_checks(partitions_def))
