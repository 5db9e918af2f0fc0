"""The pipeline's one registry: every step (the asset it materialises, the stage package
that computes it, how it is partitioned, what it reads) in pipeline order, and the jobs that
run them, in the order they run.

Everything that needs the order reads it here: the Dagster jobs (`definitions`), the
factory's automation list (`defs/factory`), the demo runner (`demo/runner`). A test checks
that this order and these upstreams are the Dagster asset graph's (a step registered before
one it reads fails it). The table names, and which are per source, stay in
`storage/tables.py` (the storage layer reads them, and imports nothing above it); a stage's
table schema and keys are declared once, on its stage (`engine.stage.TableSpec`).

No Dagster and no stage code here: names and order only, cheap to import.
"""

from __future__ import annotations

from dataclasses import dataclass

from prx_assets.storage.tables import (
    ATTRIBUTES,
    BUCKETED_IMAGES,
    CAPTION_LABELS,
    CAPTIONS,
    CONCEPTS,
    CORPUS,
    DUPLICATES,
    IMAGE_EMBEDDINGS,
    MDS_SHARDS,
    OPT_OUTS,
    PHASHES,
    RAW_IMAGES,
    SEMANTIC_DUPLICATES,
    SKIP_LISTS,
    SUBSETS,
)

PER_SOURCE = "per_source"  # one partition per configured source
GLOBAL = "global"  # one table over every source, unpartitioned
SUBSET = "subset"  # one partition per subset of subsets.yaml


@dataclass(frozen=True)
class Step:
    """One asset of the pipeline: `asset` (its key, and its table's or artifact's name),
    the package under `prx_assets/stages/` that computes it, its partitioning, the assets
    it reads, and whether the factory's automation materialises it after raw_images."""

    asset: str
    stage: str
    partitioning: str
    upstream: tuple[str, ...] = ()
    automated: bool = False


@dataclass(frozen=True)
class Job:
    """A job of the pipeline: the steps it materialises, per source, across sources or per
    subset; `semantic` jobs run only when semantic curation is asked for."""

    name: str
    partitioning: str
    assets: tuple[str, ...]
    description: str
    semantic: bool = False


STEPS: tuple[Step, ...] = (
    Step(RAW_IMAGES, "ingest", PER_SOURCE),
    Step(BUCKETED_IMAGES, "images", PER_SOURCE, (RAW_IMAGES,), automated=True),
    Step(PHASHES, "images", PER_SOURCE, (RAW_IMAGES,), automated=True),
    Step(CAPTIONS, "captions", PER_SOURCE, (BUCKETED_IMAGES, RAW_IMAGES), automated=True),
    Step(CAPTION_LABELS, "labels", PER_SOURCE, (CAPTIONS,), automated=True),
    Step(ATTRIBUTES, "attributes", PER_SOURCE, (CAPTIONS, BUCKETED_IMAGES)),
    Step(MDS_SHARDS, "shards", PER_SOURCE, (BUCKETED_IMAGES, CAPTIONS), automated=True),
    Step(IMAGE_EMBEDDINGS, "semantic", PER_SOURCE, (BUCKETED_IMAGES, CAPTION_LABELS)),
    # Automated: an update regroups only the clusters new embeddings touch, at the
    # recorded fit (`semantic/semdedup_streamed`). Concepts refit every run: by hand.
    Step(SEMANTIC_DUPLICATES, "semantic", GLOBAL, (IMAGE_EMBEDDINGS, PHASHES), automated=True),
    Step(CONCEPTS, "semantic", GLOBAL, (IMAGE_EMBEDDINGS,)),
    Step(DUPLICATES, "dedup", GLOBAL, (PHASHES,), automated=True),
    Step(OPT_OUTS, "opt_outs", GLOBAL, (DUPLICATES, RAW_IMAGES)),
    Step(SKIP_LISTS, "skip_lists", PER_SOURCE, (CAPTION_LABELS, CONCEPTS, DUPLICATES,
                                                MDS_SHARDS, OPT_OUTS, SEMANTIC_DUPLICATES),
         automated=True),
    Step(CORPUS, "corpus", GLOBAL, (ATTRIBUTES, BUCKETED_IMAGES, CAPTION_LABELS, CAPTIONS,
                                    PHASHES, RAW_IMAGES)),
    Step(SUBSETS, "subsets", SUBSET, (MDS_SHARDS, SKIP_LISTS, ATTRIBUTES, CAPTION_LABELS,
                                      CONCEPTS)),
)

JOBS: tuple[Job, ...] = (
    # Ends with the source's skip lists: a fresh tree never goes out without the sidecars
    # that apply the opt-outs recorded so far (fail closed).
    Job("source_job", PER_SOURCE,
        (RAW_IMAGES, BUCKETED_IMAGES, PHASHES, CAPTIONS, CAPTION_LABELS, ATTRIBUTES,
         MDS_SHARDS, SKIP_LISTS),
        "Every asset of the corpus for one source, ending with its skip lists."),
    # Semantic curation runs on its own: embeddings per source (after captions and labels),
    # then the global semantic duplicates and concepts (before skip_lists_job applies them).
    Job("embeddings_job", PER_SOURCE, (IMAGE_EMBEDDINGS,),
        "One source's image embeddings (after source_job).", semantic=True),
    Job("semantic_job", GLOBAL, (SEMANTIC_DUPLICATES, CONCEPTS),
        "Semantic duplicates and concepts across sources (after embeddings_job).",
        semantic=True),
    Job("dedup_job", GLOBAL, (DUPLICATES, OPT_OUTS),
        "Global duplicates and the opt-out audit."),
    # Skip lists end source_job; they run again after dedup_job, per source, to apply the
    # global duplicates.
    Job("skip_lists_job", PER_SOURCE, (SKIP_LISTS,),
        "One source's skip lists (after dedup_job)."),
    Job("corpus_table_job", GLOBAL, (CORPUS,), "The searchable corpus table across sources."),
    # Subsets are partitioned by subset, not by source; the job exists only when the subsets
    # file defines some (`defs/subsets`).
    Job("subsets_job", SUBSET, (SUBSETS,), "Build one subset's tree (after skip_lists_job)."),
)


def step(asset: str) -> Step:
    return next(s for s in STEPS if s.asset == asset)


def automated() -> tuple[str, ...]:
    """The assets the factory's automation materialises once raw_images changed, in the
    order they follow it."""
    return tuple(s.asset for s in STEPS if s.automated)


def assets_of(partitioning: str) -> tuple[str, ...]:
    return tuple(s.asset for s in STEPS if s.partitioning == partitioning)
