"""attributes: one structured record per kept image and source, in the `gpu` pool, versioned
and incremental like captions, with its checks.

The default backend derives what it can from the caption on the CPU (records marked
`caption_derived`); `vllm` runs the captioning VLM with structured-output decoding."""


from collections import Counter

import dagster as dg

from prx_assets.defs.asset_leases import asset_lease
from prx_assets.defs.captions import GPU_POOL
from prx_assets.defs.executor import MODEL_STEP_TAG
from prx_assets.defs.metadata import counts_table, pin_inputs, stage_result
from prx_assets.engine.progress import StageProgress
from prx_assets.stages.attributes.backends import VLLMAttributeSettings
from prx_assets.stages.attributes.runs import (
    AttributerSpec,
    attribute_coverage,
    tag_source,
)
from prx_assets.stages.attributes.schema import SCHEMA_VERSION, STATUS_OK
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
    actors: int = 0  # 0: caption, one per `threads_per_actor` CPUs; transformers, one
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
        op_tags={MODEL_STEP_TAG: "true"},
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
        inputs = pin_inputs(store, source, CAPTIONS, BUCKETED_IMAGES)
        bucketed = inputs[BUCKETED_IMAGES]
        table = store.table(ATTRIBUTES, source)
        caption_filter = active_caption_filter(caption_version)
        progress = StageProgress(f"{ATTRIBUTES}[{source}]", None, context.log.info,
                                 unit="images")
        with asset_lease(context, store):
            report = tag_source(inputs[CAPTIONS], table, caption_version, caption_filter, spec,
                                bucketed if bucketed.version is not None else None,
                                attributer.chunk_rows,
                                lambda r: progress.update(r.commits.rows, total=r.to_do))
        progress.total = report.to_do
        progress.finish()
        cover = attribute_coverage(inputs[CAPTIONS], table, caption_filter, caption_version,
                                   report.attribute_version)
        return stage_result(
            context, inputs=inputs, lance_version=report.lance_version,
            processed=report.written, reused=max(0, cover.rows() - report.written), removed=0,
            seconds=report.seconds, data_version=dg.DataVersion(
                f"{caption_version}/{report.attribute_version}@{report.lance_version}"),
            metadata={
                "caption_version": caption_version,
                "attribute_version": report.attribute_version,
                "schema_version": spec.schema_version,
                "backend": spec.backend, "model": spec.model_name, "origin": spec.origin,
                "records_by_status": counts_table(Counter(cover.counts), "status"),
                "valid_share": round(cover.share(cover.rows(STATUS_OK)), 4),
                "reasons": "; ".join(report.examples) or "none",
                "dagster/row_count": cover.rows(),
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
        share = cover.share(cover.rows(STATUS_OK, "invalid"))
        return dg.AssetCheckResult(passed=share >= config.min_recorded_share, metadata={
            "recorded_share": round(share, 4), "valid": cover.rows(STATUS_OK),
            "invalid_with_reason": cover.rows("invalid"),
            "failed": cover.rows("failed"), "captions": cover.inputs})

    return [every_image_recorded]


def attribute_defs(partitions_def: dg.PartitionsDefinition) -> dg.Definitions:
    return dg.Definitions(assets=[build_attributes(partitions_def)],
                          asset_checks=attribute_checks(partitions_def))
