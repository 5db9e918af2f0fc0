"""Incremental attribute tagging of one source.

Work = the active caption version's usable captions minus the ids already tagged under the
same (caption version, attribute version) pair, with a record at least as new as their
caption. Rows are tagged by the spec's backend in Ray and merge-inserted in chunks keyed on
(id, caption_version, attribute_version) by the chunked-commit runner: a killed run loses at
most the chunk in flight, a rerun never doubles a row, an engine failure (`failed`) is
retried on the next run, and an answer that never validated is kept as `invalid` with why.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import pyarrow as pa
import pyarrow.compute as pc
import ray.data

from prx_assets.engine.batches import (
    IN_PROCESS_ROWS,
    actor_pool,
    batch_fn,
    in_this_process,
    model_step,
)
from prx_assets.engine.stage import (
    Coverage,
    Pending,
    StageReport,
    TableSpec,
    coverage,
    run_stage,
)
from prx_assets.stages.attributes.backends import (
    INSTRUCTIONS,
    VLLMAttributeSettings,
    chat_prompt,
    load_decoder,
    tagged_from_answers,
    vllm_sampling_params,
    vllm_tagged,
)
from prx_assets.stages.attributes.caption_derived import (
    DESCRIPTIONS,
    EMITTED,
    CaptionAttributer,
    withheld_reason,
)
from prx_assets.stages.attributes.schema import (
    FINAL_STATUSES,
    ORIGIN_CAPTION,
    ORIGIN_MODEL,
    SCHEMA_VERSION,
    STATUS_OK,
    Tagged,
    attribute_rows,
    attributes_schema,
    parse_record,
    schema_text,
    validate,
)
from prx_assets.stages.captions.consumers import (
    CaptionConsumer,
)
from prx_assets.storage.changes import up_to_date_ids
from prx_assets.storage.filters import all_of, eq_filter, in_filter
from prx_assets.storage.refs import TableRef

BACKENDS = ("caption", "transformers", "vllm")


@dataclass(frozen=True)
class AttributerSpec:
    """Which backend tags images, with what; the fields that change a record are hashed
    into the attribute version."""

    backend: str = "caption"  # the CPU default: derived from captions (MiniLM zero-shot)
    model: str = ""  # transformers: a local folder; vllm: see `vllm`
    schema_version: str = SCHEMA_VERSION
    batch_size: int = 32
    # The most actors; 0: the caption backend one per `threads_per_actor` CPUs of the
    # cluster (as labels), a local model one.
    actors: int = 0
    threads_per_actor: int = 1
    # At most this many captions are tagged in the run's process by the caption backend.
    in_process_rows: int = IN_PROCESS_ROWS
    vllm: VLLMAttributeSettings = field(default_factory=VLLMAttributeSettings)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"attribute backend {self.backend!r}: one of {BACKENDS}")
        if self.backend == "transformers" and not self.model:
            raise ValueError("the transformers attribute backend needs a model folder")

    @property
    def origin(self) -> str:
        return ORIGIN_CAPTION if self.backend == "caption" else ORIGIN_MODEL

    @property
    def model_name(self) -> str:
        if self.backend == "caption":
            from prx_assets.models.embeddings import MODEL_ID
            return MODEL_ID
        return self.vllm.model if self.backend == "vllm" else self.model

    def version(self) -> str:
        """`<backend>-<12 hex>` of the schema, model, prompt or descriptions, sampling."""
        parts: dict = {"schema": schema_text(self.schema_version), "model": self.model_name}
        if self.backend == "caption":
            from prx_assets.models.embeddings import model_fingerprint
            parts.update(descriptions=DESCRIPTIONS, weights=model_fingerprint(),
                         emitted=EMITTED)
        else:
            parts.update(prompt=INSTRUCTIONS, decoding="structured")
        if self.backend == "vllm":
            parts.update(sampling=vllm_sampling_params(), retries=self.vllm.retries,
                         image_budget=self.vllm.image_budget)
        blob = json.dumps(parts, sort_keys=True, default=str).encode()
        return f"{self.backend}-{hashlib.sha256(blob).hexdigest()[:12]}"


def active_attributes_filter(caption_version: str, attribute_version: str) -> str:
    """Lance SQL for the rows downstream reads: the active pair's valid records."""
    condition = all_of(eq_filter("caption_version", caption_version),
                       eq_filter("attribute_version", attribute_version),
                       eq_filter("status", STATUS_OK))
    assert condition is not None  # three conditions, none empty
    return condition


def _done_filter(caption_version: str, attribute_version: str) -> str:
    condition = all_of(eq_filter("caption_version", caption_version),
                       eq_filter("attribute_version", attribute_version),
                       in_filter("status", FINAL_STATUSES))
    assert condition is not None
    return condition


# --- the stages (Ray Data callables) -------------------------------------------------------

class CaptionAttributeStage:
    """The CPU default: one MiniLM per actor; caption rows in, attribute rows out."""

    def __init__(self, attribute_version: str, schema_version: str, threads: int = 1):
        self.version = attribute_version
        self.schema_version = schema_version
        self.attributer = CaptionAttributer(version=schema_version, threads=threads)
        self.withheld = withheld_reason(self.attributer.emit, schema_version)

    def __call__(self, batch: pa.Table) -> pa.Table:
        records = self.attributer.records(batch.column("caption").to_pylist())
        tagged = [replace(_checked(i, cv, record, ORIGIN_CAPTION, self.schema_version),
                          withheld=self.withheld)
                  for i, cv, record in zip(batch.column("id").to_pylist(),
                                           batch.column("caption_version").to_pylist(),
                                           records, strict=True)]
        return attribute_rows(tagged, self.version, self.schema_version)


def _checked(id_: str, caption_version: str, record: dict, origin: str, schema_version: str
             ) -> Tagged:
    """A record validated before it is written; a caption-derived one may leave fields out."""
    errors = validate(record, schema_version, partial=origin == ORIGIN_CAPTION)
    if errors:
        return Tagged(id_, caption_version, None, "invalid", origin, "; ".join(errors)[:500])
    return Tagged(id_, caption_version, record, STATUS_OK, origin)


class TransformersAttributeStage:
    """Local weights under `StructuredDecoder`: one model per actor."""

    def __init__(self, model: str, attribute_version: str, schema_version: str,
                 threads: int = 1):
        self.decoder = load_decoder(model, threads)
        self.version = attribute_version
        self.schema_version = schema_version

    def __call__(self, batch: pa.Table) -> pa.Table:
        tagged = [self.tag(i, cv, caption) for i, cv, caption in zip(
            batch.column("id").to_pylist(), batch.column("caption_version").to_pylist(),
            batch.column("caption").to_pylist(), strict=True)]
        return attribute_rows(tagged, self.version, self.schema_version)

    def tag(self, id_: str, caption_version: str, caption: str | None) -> Tagged:
        try:
            answer = self.decoder.decode(chat_prompt(self.decoder.tokenizer, caption))
        except Exception as exc:  # one bad row is recorded, the partition goes on
            return Tagged(id_, caption_version, None, "failed", ORIGIN_MODEL,
                          f"{type(exc).__name__}: {exc}"[:500])
        record, reason = parse_record(answer, self.schema_version)
        status = STATUS_OK if record is not None else "invalid"
        return Tagged(id_, caption_version, record, status, ORIGIN_MODEL, reason)


def with_images(batch: pa.Table, bucketed: TableRef) -> pa.Table:
    """The vLLM backend's requests: caption rows with their image bytes (one Lance read
    per batch, by id)."""
    ids = batch.column("id").to_pylist()
    images = bucketed.to_table(columns=["id", "image"], filter=in_filter("id", ids))
    return batch.join(images, "id", join_type="inner")


def _vllm_rows(batch: pa.Table, attribute_version: str, schema_version: str) -> pa.Table:
    return attribute_rows(tagged_from_answers(batch.to_pydict()), attribute_version,
                          schema_version)


def attribute_stage(pending: ray.data.Dataset, spec: AttributerSpec,
                    bucketed: TableRef | None = None, rows: int | None = None
                    ) -> ray.data.Dataset:
    """Caption rows in (`rows` of them, when known), `attributes_schema` rows out, through
    the spec's backend."""
    version = spec.version()
    if spec.backend == "caption" and rows is not None and rows <= spec.in_process_rows:
        stage = CaptionAttributeStage(version, spec.schema_version, spec.threads_per_actor)
        return in_this_process(pending, stage, spec.batch_size,
                               attributes_schema(spec.schema_version))
    # The caption backend in the caption labeller's pool (one actor had the other core
    # idle for the whole stage); a local VLM is one actor unless asked (each holds a model).
    compute = (actor_pool(spec.actors, spec.threads_per_actor, rows)
               if spec.backend == "caption"
               else ray.data.ActorPoolStrategy(size=max(1, spec.actors)))
    pool = {"batch_format": "pyarrow", "batch_size": spec.batch_size, "compute": compute,
            "num_cpus": spec.threads_per_actor}
    if spec.backend == "caption":
        return pending.map_batches(CaptionAttributeStage, fn_constructor_kwargs={
            "attribute_version": version, "schema_version": spec.schema_version,
            "threads": spec.threads_per_actor}, **pool)  # type: ignore[arg-type]
    if spec.backend == "transformers":
        return pending.map_batches(TransformersAttributeStage, fn_constructor_kwargs={
            "model": spec.model, "attribute_version": version,
            "schema_version": spec.schema_version,
            "threads": spec.threads_per_actor}, **pool)  # type: ignore[arg-type]
    if bucketed is None:
        raise ValueError("the vllm attribute backend reads images: pass the bucketed table")
    requests = pending.map_batches(batch_fn(with_images), fn_kwargs={"bucketed": bucketed},
                                   batch_format="pyarrow", batch_size=spec.vllm.batch_size)
    return vllm_tagged(requests, spec.vllm).map_batches(
        batch_fn(_vllm_rows), fn_kwargs={"attribute_version": version,
                               "schema_version": spec.schema_version},
        batch_format="pyarrow", batch_size=None)


# --- the run ---------------------------------------------------------------------------------

ATTRIBUTES_TABLE = TableSpec(attributes_schema(SCHEMA_VERSION), ("id", "caption_version",
                                                                   "attribute_version"))


@dataclass
class AttributeRunReport(StageReport):
    caption_version: str
    attribute_version: str


def tagged_ids(attributes: TableRef, captions: TableRef, caption_filter: str,
               caption_version: str, attribute_version: str) -> pa.Array:
    """Ids with a final record under the pair no older than their caption row (a caption
    written again since, for a changed source item, is tagged again)."""
    if not attributes.exists():
        return pa.array([], pa.string())
    done = attributes.latest().to_table(
        columns=["id", "created_at"], filter=_done_filter(caption_version, attribute_version))
    captioned = captions.to_table(columns=["id", "created_at"], filter=caption_filter)
    return up_to_date_ids(done, captioned)


class AttributeStage(CaptionConsumer[AttributeRunReport]):
    """Captions in, one attribute record per usable caption out, under the active
    (caption version, attribute version) pair."""

    failpoint = "attributes.chunk_committed"

    def __init__(self, caption_version: str, caption_filter: str, spec: AttributerSpec,
                 bucketed: TableRef | None = None):
        super().__init__(caption_version, caption_filter, spec.version())
        self.spec, self.bucketed = spec, bucketed
        self.table = replace(ATTRIBUTES_TABLE, schema=attributes_schema(spec.schema_version))

    def report(self) -> AttributeRunReport:
        return AttributeRunReport(*self.pair)

    def done_filter(self) -> str:
        return _done_filter(*self.pair)

    def pending_in_full(self, captions: TableRef, target: TableRef) -> Pending:
        """Every usable caption compared with every final record."""
        done = tagged_ids(target, captions, self.caption_filter, *self.pair)
        n = max(0, captions.count_rows(filter=self.caption_filter) - len(done))
        return self.read_all_but(captions, done, n)

    def transform(self, rows: ray.data.Dataset, count: int) -> ray.data.Dataset:
        return attribute_stage(rows, self.spec, self.bucketed, count)

    def count(self, chunk: pa.Table, report: AttributeRunReport) -> None:
        report.counts.update(chunk.column("status").to_pylist())
        failed = chunk.filter(pc.not_equal(chunk.column("status"), STATUS_OK))
        report.keep_examples(failed.column("error").to_pylist())

    def finished(self, report: AttributeRunReport) -> bool:
        # Failures are retried by handing the same changes on: no record past them.
        return all(status in FINAL_STATUSES for status in report.counts)


def tag_source(captions: TableRef, attributes: TableRef, caption_version: str,
               caption_filter: str, spec: AttributerSpec, bucketed: TableRef | None = None,
               chunk_rows: int = 1024,
               on_chunk: Callable[[AttributeRunReport], None] | None = None
               ) -> AttributeRunReport:
    """Tag the pending captions of one source; `captions` pinned by the caller is the
    version tagged (the lineage it records)."""
    with model_step():  # shares the CPUs with caption_labels' pool (`actor_pool`)
        return run_stage(AttributeStage(caption_version, caption_filter, spec, bucketed),
                         captions, attributes, chunk_rows, on_chunk)


def attribute_coverage(captions: TableRef, attributes: TableRef, caption_filter: str,
                       caption_version: str, attribute_version: str) -> Coverage:
    """Usable captions of the active version, and the records under the pair by status."""
    return coverage(captions, caption_filter, attributes, "status", all_of(
        eq_filter("caption_version", caption_version),
        eq_filter("attribute_version", attribute_version)))
