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

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypedDict

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray.data

from prx_assets.engine.batches import IN_PROCESS_ROWS, in_this_process
from prx_assets.engine.chunked import (
    ChunkedReport,
    ChunkedRun,
    CommitTarget,
    drop_ids,
    keep_ids,
    run_chunked,
)
from prx_assets.engine.id_sets import IdSet
from prx_assets.engine.removals import DELETE_IDS_PER_COMMIT, delete_ids
from prx_assets.models.embeddings import shared_embedder
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
from prx_assets.storage.changes import (
    consumed_at,
    handed_changes,
    not_up_to_date,
    read_ids,
    record_consumed,
    up_to_date_ids,
)
from prx_assets.storage.failpoints import failpoint
from prx_assets.storage.lance_tables import FragmentPolicy, create_empty
from prx_assets.storage.refs import TableRef
from prx_assets.storage.table_stats import value_counts

LABEL_KEYS = ["id", "caption_version", "classifier_version"]
UPSTREAM = "captions"  # what the labels table's record of the captions it consumed is called
LOOKUP_CAPTIONS = 10_000  # changed captions labelled by id; past it, compared in full
LABELS_FRAGMENTS = FragmentPolicy(target_bytes=1 << 30, max_rows=1 << 20)
CAPTION_COLUMNS = ["id", "caption_version", "caption"]
# What a label stage yields: LABELS_SCHEMA rows plus an error (label null when it failed).
STAGE_SCHEMA = pa.schema([f.with_nullable(True) if f.name == "label" else f
                          for f in LABELS_SCHEMA] + [pa.field("error", pa.string())])
BACKENDS = ("embedded", "openai", "vllm")


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

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown classifier backend {self.backend!r}; one of {BACKENDS}")
        if self.backend == "openai" and self.openai is None:
            raise ValueError("the openai backend needs OpenAISettings(base_url=...)")

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
class LabelRunReport(ChunkedReport):
    caption_version: str
    classifier_version: str
    labels: Counter = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)  # a few examples
    removed: int = 0  # label rows of items gone from the captions (removed upstream)
    to_label: int = 0  # captions pending when the run started (the progress total)

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


def record_tag(caption_version: str, classifier_version: str) -> str:
    """What the labels' record of the captions was made under: the active pair."""
    return f"{caption_version}/{classifier_version}"


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


def pending_captions(captions: TableRef, caption_filter: str, done: pa.Array
                     ) -> ray.data.Dataset:
    """Usable captions of the active version whose id is not in `done`."""
    return drop_ids(captions.read(columns=CAPTION_COLUMNS, filter=caption_filter), done)


class EmbeddingStage:
    """Adds the MiniLM embedding (for backends whose labels come from elsewhere)."""

    def __init__(self, threads: int = 1):
        self.embedder = shared_embedder(threads)

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
    """Actors for the pool: `spec.actors`, or with 0 one per `threads_per_actor` CPUs of the
    cluster (a single actor left a 2-CPU node half idle for the whole stage)."""
    if spec.actors > 0:
        return spec.actors
    return max(1, int(cpus // max(1, spec.threads_per_actor)))


# Captions one actor should have ahead of it before the pool starts at full size: below,
# a second model load (torch import and MiniLM, ~8 s) costs more than it saves.
CAPTIONS_PER_ACTOR = 500


def actor_pool(spec: LabelerSpec, pending: int | None = None) -> ray.data.ActorPoolStrategy:
    """A pool of up to `pool_size` actors, starting at full size when `pending` captions
    give each of them CAPTIONS_PER_ACTOR (grown one at a time by Ray Data, the second
    actor of a 2-CPU node loaded its model a third of the way into the stage), else from
    one actor, growing while captions are queued (a small source loads one model)."""
    size = pool_size(spec, ray.cluster_resources().get("CPU", 1))
    initial = size if pending and pending >= size * CAPTIONS_PER_ACTOR else 1
    return ray.data.ActorPoolStrategy(min_size=1, max_size=size, initial_size=initial)


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
    embedded = pending.map_batches(EmbeddingStage, fn_constructor_kwargs={
        "threads": spec.threads_per_actor}, **pool)
    labelled = build_vllm_labeler(spec.vllm)(embedded)
    return labelled.map_batches(_vllm_rows, fn_kwargs={"classifier_version": version},
                                batch_format="pyarrow")


def _vllm_rows(batch: pa.Table, classifier_version: str) -> pa.Table:
    labels = batch.column("label").to_pylist()
    vectors = np.asarray(batch.column("embedding").to_pylist(), dtype=np.float32)
    scores = np.asarray(batch.column("scores").to_pylist(), dtype=np.float32)
    errors = [None if label else "not a label" for label in labels]
    return _stage_rows(batch, classifier_version, labels, scores, vectors, errors)


def ensure_labels_table(labels: TableRef) -> int:
    """An empty labels table, so downstream readers and checks always find one."""
    return create_empty(labels, LABELS_SCHEMA)


def labels_target(labels: TableRef) -> CommitTarget:
    """A source's labels table: one row per (id, caption version, classifier version)."""
    return CommitTarget(labels, LABELS_SCHEMA, LABEL_KEYS, LABELS_FRAGMENTS)


def labelled_rows(chunk: pa.Table) -> pa.Table:
    """The rows of a stage chunk that got a label, as LABELS_SCHEMA rows: a failure is not
    written, so the next run labels it again."""
    return chunk.filter(pc.is_valid(chunk.column("label"))).drop_columns(["error"])


def label_source(captions: TableRef, labels: TableRef, caption_version: str,
                 caption_filter: str, spec: LabelerSpec, chunk_rows: int = 4096,
                 on_chunk: Callable[[LabelRunReport], None] | None = None) -> LabelRunReport:
    """Label the pending captions of one source and commit them chunk by chunk.

    `captions` is read at its version (pin it with `.at(version)`, so the version the
    caller records as lineage is the one labelled; unpinned: the latest)."""
    report = LabelRunReport(caption_version, spec.version())
    ensure_labels_table(labels)
    if not captions.exists():
        raise FileNotFoundError(f"{captions} does not exist: materialise captions first")
    captions = captions.pinned()
    tag = record_tag(caption_version, report.classifier_version)
    changed = handed_changes(captions, labels, UPSTREAM, tag, caption_filter, LOOKUP_CAPTIONS)
    if changed is None:  # every caption compared with every label
        report.removed = drop_orphan_labels(labels, captions)
        done = labelled_ids(labels, caption_version, report.classifier_version, captions,
                            caption_filter)
        report.to_label = count_pending(captions, caption_filter, done)
        # Nothing to do: no actor pool, no model load.
        pending = pending_captions(captions, caption_filter, done) if report.to_label else None
    else:  # handed the captions' changes since the record
        added, removed = changed
        report.removed = delete_ids(labels.latest(), removed)
        todo = not_up_to_date(added, labels, active_labels_filter(
            caption_version, report.classifier_version), captions, caption_filter)
        report.to_label = len(todo)
        pending = read_ids(captions, todo, CAPTION_COLUMNS, caption_filter)

    def count(chunk: pa.Table, run: ChunkedRun) -> None:
        report.commits = run
        failpoint("labels.chunk_committed")
        failed = pc.is_null(chunk.column("label"))
        errors = chunk.filter(failed).column("error").to_pylist()
        report.errors.extend(errors[: max(0, 5 - len(report.errors))])
        report.labels.update(chunk.filter(pc.invert(failed)).column("label").to_pylist())
        if on_chunk:
            on_chunk(report)

    report.commits = run_chunked(pending, lambda rows: label_stage(rows, spec, report.to_label),
                                 labels_target(labels), chunk_rows,
                                 to_commit=labelled_rows, on_chunk=count)
    if report.failed == 0:  # failures are retried by handing the same changes on
        record_consumed(labels, UPSTREAM, consumed_at(captions.open(), tag))
    return report


@dataclass(frozen=True)
class LabelCoverage:
    captions: int  # usable captions of the active version
    counts: dict[str, int]  # label -> rows labelled under the active pair

    @property
    def labelled(self) -> int:
        return sum(self.counts.values())

    @property
    def share(self) -> float:
        return self.labelled / self.captions if self.captions else 1.0

    @property
    def shares(self) -> dict[str, float]:
        total = self.labelled
        return {label: self.counts.get(label, 0) / total if total else 0.0 for label in LABELS}


def label_coverage(captions: TableRef, labels: TableRef, caption_filter: str,
                   caption_version: str, classifier_version: str) -> LabelCoverage:
    """Counts for the checks and metadata, from the committed tables (no embeddings read)."""
    usable = captions.count_rows(filter=caption_filter) if captions.exists() else 0
    if not labels.exists():
        return LabelCoverage(usable, {})
    counts = value_counts(labels, "label",
                          active_labels_filter(caption_version, classifier_version))
    return LabelCoverage(usable, dict(counts))
