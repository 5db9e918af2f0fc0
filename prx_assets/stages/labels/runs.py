"""Incremental labelling of one source's captions.

Work = the active caption version's usable captions minus the ids already labelled under
the same (caption_version, classifier_version) pair. Captions are embedded with MiniLM and
labelled in a Ray actor pool (one model per actor); the chunked-commit runner
(`engine.chunked`) streams results back to the driver and merge-inserts them in chunks keyed
on (id, caption_version, classifier_version): a killed run loses at most the chunk in
flight, a rerun never doubles a row, and the previous table version stays readable
throughout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypedDict

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray.data

from prx_assets.engine import batches
from prx_assets.engine.batches import IN_PROCESS_ROWS, in_this_process
from prx_assets.engine.chunked import keep_ids
from prx_assets.engine.id_sets import IdSet
from prx_assets.engine.removals import DELETE_IDS_PER_COMMIT, delete_ids
from prx_assets.engine.stage import (
    Coverage,
    Pending,
    StageReport,
    TableSpec,
    coverage,
    run_stage,
)
from prx_assets.models.embeddings import GPU_BATCH_SIZE, shared_embedder
from prx_assets.stages.captions.consumers import CaptionConsumer
from prx_assets.stages.labels.backends import (
    QUESTION,
    OpenAILabelClient,
    OpenAISettings,
    VLLMSettings,
    build_vllm_labeler,
    vllm_sampling_params,
)
from prx_assets.stages.labels.labels import (
    DEFAULT_L2,
    LABELS,
    LABELS_SCHEMA,
    EmbeddedLabeler,
    active_labels_filter,
    embedded_classifier_version,
    label_rows,
    version_hash,
)
from prx_assets.storage.changes import up_to_date_ids
from prx_assets.storage.refs import TableRef

# What a label stage yields: LABELS_SCHEMA rows plus an error (label null when it failed).
STAGE_SCHEMA = pa.schema([f.with_nullable(True) if f.name == "label" else f
                          for f in LABELS_SCHEMA] + [pa.field("error", pa.string())])
BACKENDS = ("embedded", "openai", "vllm")
EMBED_DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class LabelerSpec:
    """Which backend labels captions, and how many workers it runs."""

    backend: str = "embedded"
    actors: int = 0  # the most actors; 0: as many as the cluster's CPUs allow (`pool_size`)
    threads_per_actor: int = 1
    batch_size: int = 64
    # At most this many captions are labelled in the run's process (`in_this_process`).
    in_process_rows: int = IN_PROCESS_ROWS
    l2: float = DEFAULT_L2
    openai: OpenAISettings | None = None
    vllm: VLLMSettings = VLLMSettings()
    # Where captions are embedded: "auto" is the GPU under the vllm backend (a CPU pool
    # embeds 4-10 captions/s per core, so it would bound the GPU), the CPU otherwise.
    embed_device: str = "auto"

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown classifier backend {self.backend!r}; one of {BACKENDS}")
        if self.embed_device not in EMBED_DEVICES:
            raise ValueError(f"unknown embed_device {self.embed_device!r}; one of "
                             f"{EMBED_DEVICES}")
        if self.backend == "openai" and self.openai is None:
            raise ValueError("the openai backend needs OpenAISettings(base_url=...)")

    def embedding_device(self) -> str:
        if self.embed_device != "auto":
            return self.embed_device
        return "cuda" if self.backend == "vllm" else "cpu"

    def embedding_gpus(self) -> float:
        """Each embedding actor's share of a GPU: the part the vLLM engine leaves (a whole
        GPU when the engine takes all of its own); none on the CPU."""
        if self.embedding_device() == "cpu":
            return 0.0
        share = 1.0 - self.vllm.gpu_share if self.backend == "vllm" else 1.0
        return round(share, 6) or 1.0

    def version(self) -> str:
        """Short hash of backend, model, training set / prompt and classifier parameters."""
        if self.backend == "embedded":
            return f"embedded-{embedded_classifier_version(self.l2)}"
        if self.backend == "openai":
            assert self.openai is not None  # __post_init__ refuses openai without settings
            model = self.openai.model
        else:
            model = self.vllm.model
        return f"{self.backend}-" + version_hash(backend=self.backend, model=model,
                                                prompt=QUESTION, sampling=vllm_sampling_params())


@dataclass
class LabelRunReport(StageReport):
    caption_version: str
    classifier_version: str




    @property
    def failed(self) -> int:
        """Captions that got no label (left out of the table, retried on the next run)."""
        return self.commits.rows - self.commits.committed

    @property
    def pending(self) -> int:
        return self.commits.rows

    @property
    def captions_per_s(self) -> float:
        return self.commits.rows_per_s


def labelled_ids(labels: TableRef, caption_version: str, classifier_version: str,
                 captions: TableRef, caption_filter: str) -> pa.Array:
    """Ids labelled under the pair from the caption they have now (ids and timestamps only).

    A label older than its caption row is stale: the caption was written again since (its
    source file changed, see `stages.captions.runs.changed_ids`) and must be labelled again."""
    if not labels.exists():
        return pa.array([], pa.string())
    labelled = labels.latest().to_table(
        columns=["id", "created_at"],
        filter=active_labels_filter(caption_version, classifier_version))
    captioned = captions.to_table(columns=["id", "created_at"], filter=caption_filter)
    return up_to_date_ids(labelled, captioned)


def drop_orphan_labels(labels: TableRef, captions: TableRef,
                       chunk: int = DELETE_IDS_PER_COMMIT) -> int:
    """Delete the label rows (every version pair) of ids that have no caption row any more:
    their item left the source, so its caption was dropped upstream. Returns rows deleted."""
    if not labels.exists():
        return 0
    captioned = IdSet.of(captions.to_table(columns=["id"]).column("id"))
    table = labels.latest().open()
    orphans: set[str] = set()
    for batch in table.to_batches(columns=["id"]):
        ids = pa.Table.from_batches([batch])
        orphans.update(keep_ids(ids, captioned, member=False).column("id").to_pylist())
    return delete_ids(labels.latest(), pa.array(sorted(orphans), pa.string()), chunk)


def count_pending(captions: TableRef, caption_filter: str, done: pa.Array) -> int:
    scanner = captions.open().scanner(columns=["id"], filter=caption_filter)
    done_set = IdSet.of(done)  # sorted once, not hashed per batch
    return sum(keep_ids(pa.Table.from_batches([b]), done_set, member=False).num_rows
               for b in scanner.to_batches())


class EmbeddingStage:
    """Adds the MiniLM embedding (for backends whose labels come from elsewhere)."""

    def __init__(self, threads: int = 1, device: str = "cpu"):
        self.embedder = shared_embedder(threads, device)

    def __call__(self, batch: pa.Table) -> pa.Table:
        vectors = self.embedder.embed([c or "" for c in batch.column("caption").to_pylist()])
        return batch.append_column("embedding", pa.FixedSizeListArray.from_arrays(
            pa.array(vectors.ravel(), pa.float32()), vectors.shape[1]))


class OpenAILabelStage(EmbeddingStage):
    """Embeds with MiniLM, labels through the endpoint; failures carry their error."""

    def __init__(self, settings: OpenAISettings, classifier_version: str, threads: int = 1):
        super().__init__(threads)
        self.client = OpenAILabelClient(settings)
        self.classifier_version = classifier_version

    def __call__(self, batch: pa.Table) -> pa.Table:
        captions = [c or "" for c in batch.column("caption").to_pylist()]
        vectors = self.embedder.embed(captions)
        replies = self.client.label(captions)
        return _stage_rows(batch, self.classifier_version, [r.label for r in replies],
                           np.stack([r.scores for r in replies]), vectors,
                           [r.error for r in replies])


def _stage_rows(batch: pa.Table, classifier_version: str, labels: list, scores: np.ndarray,
                vectors: np.ndarray, errors: list) -> pa.Table:
    table = label_rows(batch.column("id").to_pylist(),
                       batch.column("caption_version").to_pylist(), classifier_version,
                       ["" if label is None else label for label in labels], scores, vectors)
    label = pa.array(labels, pa.string())
    table = table.set_column(table.schema.get_field_index("label"), STAGE_SCHEMA.field("label"),
                             label)
    return table.append_column(STAGE_SCHEMA.field("error"), pa.array(errors, pa.string()))


class EmbeddedLabelStage(EmbeddedLabeler):
    def __call__(self, batch: pa.Table) -> pa.Table:
        return super().__call__(batch).cast(LABELS_SCHEMA).append_column(
            STAGE_SCHEMA.field("error"), pa.nulls(batch.num_rows, pa.string())).cast(STAGE_SCHEMA)


def pool_size(spec: LabelerSpec, cpus: float) -> int:
    """Actors for the labeller's pool (`engine.batches.pool_size`)."""
    return batches.pool_size(spec.actors, spec.threads_per_actor, cpus)


# Captions one actor should have ahead of it before the pool starts at full size.
CAPTIONS_PER_ACTOR = batches.ROWS_PER_ACTOR


def actor_pool(spec: LabelerSpec, pending: int | None = None) -> ray.data.ActorPoolStrategy:
    """The labeller's pool for `pending` captions (`engine.batches.actor_pool`)."""
    return batches.actor_pool(spec.actors, spec.threads_per_actor, pending)


class _PoolArgs(TypedDict):
    """The `map_batches` arguments of every actor-pool stage of the labeller."""

    batch_format: str
    batch_size: int
    compute: ray.data.ActorPoolStrategy
    num_cpus: float


def label_stage(pending: ray.data.Dataset, spec: LabelerSpec, rows: int | None = None
                ) -> ray.data.Dataset:
    """Caption rows in (`rows` of them, when known), STAGE_SCHEMA rows out, in an actor pool
    (`actor_pool`)."""
    version = spec.version()
    if spec.backend == "embedded" and rows is not None and rows <= spec.in_process_rows:
        return in_this_process(pending, EmbeddedLabelStage(version, spec.threads_per_actor),
                               spec.batch_size, STAGE_SCHEMA)
    pool: _PoolArgs = {"batch_format": "pyarrow", "batch_size": spec.batch_size,
                       "compute": actor_pool(spec, rows), "num_cpus": spec.threads_per_actor}
    if spec.backend == "embedded":
        return pending.map_batches(EmbeddedLabelStage, fn_constructor_kwargs={
            "classifier_version": version, "threads": spec.threads_per_actor}, **pool)
    if spec.backend == "openai":
        return pending.map_batches(OpenAILabelStage, fn_constructor_kwargs={
            "settings": spec.openai, "classifier_version": version,
            "threads": spec.threads_per_actor}, **pool)
    embedded = pending.map_batches(EmbeddingStage, **embedding_pool(spec, pool))
    labelled = build_vllm_labeler(spec.vllm)(embedded)
    return labelled.map_batches(_vllm_rows, fn_kwargs={"classifier_version": version},
                                batch_format="pyarrow")


def embedding_pool(spec: LabelerSpec, cpu_pool: _PoolArgs) -> dict[str, Any]:
    """`map_batches` arguments of the embedding actors under the vllm backend: on the GPU,
    one actor per engine replica holding the share of its GPU the engine leaves (so both
    fit on one GPU); on the CPU, the CPU pool."""
    device = spec.embedding_device()
    if device == "cpu":
        return {**cpu_pool, "fn_constructor_kwargs": {"threads": spec.threads_per_actor}}
    return {"fn_constructor_kwargs": {"threads": 1, "device": device},
            "batch_format": "pyarrow", "batch_size": GPU_BATCH_SIZE,
            "compute": ray.data.ActorPoolStrategy(size=spec.vllm.concurrency),
            "num_cpus": 1, "num_gpus": spec.embedding_gpus()}


def _vllm_rows(batch: pa.Table, classifier_version: str) -> pa.Table:
    labels = batch.column("label").to_pylist()
    vectors = np.asarray(batch.column("embedding").to_pylist(), dtype=np.float32)
    scores = np.asarray(batch.column("scores").to_pylist(), dtype=np.float32)
    errors = [None if label else "not a label" for label in labels]
    return _stage_rows(batch, classifier_version, labels, scores, vectors, errors)


def labelled_rows(chunk: pa.Table) -> pa.Table:
    """The rows of a stage chunk that got a label, as LABELS_SCHEMA rows: a failure is not
    written, so the next run labels it again."""
    return chunk.filter(pc.is_valid(chunk.column("label"))).drop_columns(["error"])


class LabelStage(CaptionConsumer[LabelRunReport]):
    """Captions in, one label (scores, MiniLM embedding) per usable caption out, under the
    active (caption version, classifier version) pair; rows of captions gone upstream are
    deleted (every version pair)."""

    table = TableSpec(LABELS_SCHEMA, ("id", "caption_version", "classifier_version"))
    failpoint = "labels.chunk_committed"
    drops_removed = True

    def __init__(self, caption_version: str, caption_filter: str, spec: LabelerSpec):
        super().__init__(caption_version, caption_filter, spec.version())
        self.spec = spec

    def report(self) -> LabelRunReport:
        return LabelRunReport(*self.pair)

    def done_filter(self) -> str:
        return active_labels_filter(*self.pair)

    def pending_in_full(self, captions: TableRef, target: TableRef) -> Pending:
        """Every caption compared with every label: orphans dropped, then the captions
        without an up-to-date label."""
        removed = drop_orphan_labels(target, captions)
        done = labelled_ids(target, *self.pair, captions, self.caption_filter)
        n = count_pending(captions, self.caption_filter, done)
        pending = self.read_all_but(captions, done, n)  # none: no actor pool, no model load
        pending.removed = removed
        return pending

    def transform(self, rows: ray.data.Dataset, count: int) -> ray.data.Dataset:
        return label_stage(rows, self.spec, count)

    def to_commit(self, chunk: pa.Table) -> pa.Table:
        return labelled_rows(chunk)

    def count(self, chunk: pa.Table, report: LabelRunReport) -> None:
        failed = pc.is_null(chunk.column("label"))
        report.keep_examples(chunk.filter(failed).column("error").to_pylist())
        report.counts.update(chunk.filter(pc.invert(failed)).column("label").to_pylist())

    def finished(self, report: LabelRunReport) -> bool:
        return report.failed == 0  # failures are retried by handing the same changes on


def label_source(captions: TableRef, labels: TableRef, caption_version: str,
                 caption_filter: str, spec: LabelerSpec, chunk_rows: int = 4096,
                 on_chunk: Callable[[LabelRunReport], None] | None = None) -> LabelRunReport:
    """Label the pending captions of one source and commit them chunk by chunk.

    `captions` is read at its version (pin it with `.at(version)`, so the version the
    caller records as lineage is the one labelled; unpinned: the latest)."""
    with batches.model_step():  # shares the CPUs with attributes' pool (`actor_pool`)
        return run_stage(LabelStage(caption_version, caption_filter, spec), captions, labels,
                         chunk_rows, on_chunk)


def label_coverage(captions: TableRef, labels: TableRef, caption_filter: str,
                   caption_version: str, classifier_version: str) -> Coverage:
    """Usable captions of the active version, and the rows labelled under the pair by
    label (counted from the committed tables, no embeddings read)."""
    return coverage(captions, caption_filter, labels, "label",
                    active_labels_filter(caption_version, classifier_version))


def label_shares(cover: Coverage) -> dict[str, float]:
    """Each label's share of the labelled captions."""
    total = cover.rows()
    return {label: cover.rows(label) / total if total else 0.0 for label in LABELS}
