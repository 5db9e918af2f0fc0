"""Semantic curation: image_embeddings (per source), semantic_duplicates and concepts
(global), and the `image_encoder` resource that names the embedding space."""

import itertools

import dagster as dg
import numpy as np

from prx_assets.defs.asset_leases import asset_lease
from prx_assets.defs.metadata import input_lineage, pin_inputs, stage_result
from prx_assets.defs.resources import SourcesResource
from prx_assets.engine.batches import arrow_batches
from prx_assets.stages.captions.captions import active_caption_filter
from prx_assets.stages.semantic.concepts import (
    DEFAULT_SIZES,
    DEFAULT_TARGET_SHARE,
    MIN_ROWS_PER_LEAF,
    effective_sizes,
    largest_to_median,
    size_histogram,
)
from prx_assets.stages.semantic.embeddings import (
    caption_encoder_name,
    caption_vectors,
    encoder_name,
    image_vectors,
    index_vectors,
    kept_ids,
    plan,
    write_embeddings,
)
from prx_assets.stages.semantic.semdedup import (
    DEFAULT_CLUSTER_CAP,
    DEFAULT_CLUSTER_ROWS,
    DEFAULT_EPS,
    REPORT_EPS,
    SemDedupConfig,
)
from prx_assets.stages.semantic.semdedup_streamed import streamed_semantic_duplicates
from prx_assets.stages.semantic.semdedup_update import incremental_semantic_duplicates
from prx_assets.stages.semantic.spaces import (
    DEFAULT_MAX_DRIFT,
    concepts_tag,
    incremental_concepts,
    streamed_concepts,
)
from prx_assets.stages.semantic.streamed import (
    DEFAULT_BUCKET_ROWS,
    DEFAULT_CHUNK_ROWS,
    DEFAULT_SAMPLE_ROWS,
    IN_PROCESS_ROWS,
    SpaceInputs,
    Tasks,
    space_inputs,
)
from prx_assets.storage.filters import all_of, in_filter
from prx_assets.storage.layout import Storage
from prx_assets.storage.tables import (
    BUCKETED_IMAGES,
    CAPTION_LABELS,
    CAPTIONS,
    CONCEPTS,
    IMAGE_EMBEDDINGS,
    PHASHES,
    SEMANTIC_CLUSTERS,
    SEMANTIC_DUPLICATES,
)

CAPTION_SPACE_NOTE = ("caption space: MiniLM embeddings of the active captions (no image "
                      "encoder configured; the demo's fallback)")


class ImageEncoderResource(dg.ConfigurableResource):
    """The embedding space: a CLIP or SigLIP checkpoint folder (`checkpoint`), or, unset,
    the caption embeddings the labels stage computed."""

    checkpoint: str | None = None
    actors: int = 1
    threads_per_actor: int = 1
    batch_size: int = 32

    def encoder(self, caption_version: str) -> str:
        return (encoder_name(self.checkpoint) if self.checkpoint
                else caption_encoder_name(caption_version))

    def space_note(self) -> str:
        return f"image encoder {self.checkpoint}" if self.checkpoint else CAPTION_SPACE_NOTE


def build_image_embeddings(partitions_def: dg.PartitionsDefinition) -> dg.AssetsDefinition:
    @dg.asset(
        name=IMAGE_EMBEDDINGS, partitions_def=partitions_def, group_name="semantic",
        deps=[BUCKETED_IMAGES, CAPTION_LABELS], kinds={"ray", "lance"}, code_version="1",
        required_resource_keys={"captioner", "image_encoder", "ray_cluster", "storage"},
        description="One unit vector per kept image under the configured encoder (a CLIP / "
                    "SigLIP vision tower on Ray Data actors, or the caption embeddings when "
                    "none is configured); incremental per encoder.")
    def image_embeddings(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        source = context.partition_key
        store: Storage = context.resources.storage.get()
        image_encoder: ImageEncoderResource = context.resources.image_encoder
        caption_version = context.resources.captioner.caption_version()
        encoder = image_encoder.encoder(caption_version)
        # The caption space reads the labels' embeddings: an input only there.
        names = [BUCKETED_IMAGES] if image_encoder.checkpoint else [BUCKETED_IMAGES,
                                                                   CAPTION_LABELS]
        inputs = pin_inputs(store, source, *names)
        for name, version in inputs.versions().items():
            if version is None:
                raise dg.Failure(f"{inputs[name]} does not exist: materialise {name} first")
        bucketed = inputs[BUCKETED_IMAGES]
        table = store.table(IMAGE_EMBEDDINGS, source)
        with asset_lease(context, store):  # one writer per (asset, source)
            work = plan(kept_ids(bucketed), table, encoder)
            if image_encoder.checkpoint:
                batches = arrow_batches(image_vectors(
                    bucketed, work.todo, image_encoder.checkpoint, image_encoder.actors,
                    image_encoder.batch_size, image_encoder.threads_per_actor)) if work.todo else []
            else:
                batches = caption_vectors(inputs[CAPTION_LABELS], caption_version,
                                          work.todo) if work.todo else []
            counts = write_embeddings(table, batches, encoder, work.removed)
            index = index_vectors(table) if table.exists() else "no table"
        context.log.info(f"{source}: {counts.written} embedded, {work.reused} reused, "
                         f"{len(work.removed)} removed under {encoder}")
        return stage_result(
            context, inputs=inputs, lance_version=table.latest_version() or 0,
            processed=counts.written, reused=work.reused, removed=len(work.removed),
            metadata={
                "encoder": encoder, "space": image_encoder.space_note(),
                "failed": counts.failed, "failures": "; ".join(counts.errors or []) or "none",
                # In the caption space an image without a usable caption has no vector yet.
                "not_embedded": len(work.todo) - counts.written - counts.failed,
                "vector_index": index,
                # Vectors of another size were there (another encoder): the table was replaced.
                "replaced_other_space": counts.replaced,
            })

    return image_embeddings


class SemanticDuplicatesConfig(dg.Config):
    eps: float = DEFAULT_EPS
    # The shares reported (the SemDeDup table); the acting eps is always among them.
    report_eps: list[float] = list(REPORT_EPS)  # noqa: RUF012 (see SkipListsConfig)
    cluster_rows: int = DEFAULT_CLUSTER_ROWS
    cluster_cap: int = DEFAULT_CLUSTER_CAP
    # The k-means is fitted on a seeded sample of at most this many vectors (every vector
    # of a smaller space); every vector is then assigned in Ray tasks.
    sample_rows: int = DEFAULT_SAMPLE_ROWS
    ray_tasks: bool = True  # assignment and clusters in Ray tasks (False: in this process)
    # A space this small runs in this process: Ray's per-task start costs more than it.
    in_process_rows: int = IN_PROCESS_ROWS
    # Rows one assignment task reads, and rows one per-cluster task receives on average.
    chunk_rows: int = DEFAULT_CHUNK_ROWS
    bucket_rows: int = DEFAULT_BUCKET_ROWS
    seed: int = 0
    # A run after a full one assigns the rows written since to the recorded centroids and
    # regroups only their clusters; `refit` (or more than `max_changed_share` of the rows
    # changed, other settings, an input compacted) fits and groups every row again.
    refit: bool = False
    max_changed_share: float = 0.1
    # In the caption space (no image encoder) two images with one caption look identical,
    # so its groups are reported only unless this is set: skip lists act on image spaces.
    apply_in_caption_space: bool = False


def _space(context: dg.AssetExecutionContext, store: Storage, names: list[str]
           ) -> tuple[SpaceInputs, dict]:
    caption_version = context.resources.captioner.caption_version()
    encoder = context.resources.image_encoder.encoder(caption_version)
    inputs = space_inputs(store, names, encoder)
    if inputs.missing:
        context.log.warning(f"no image_embeddings yet for {', '.join(inputs.missing)}")
    note = context.resources.image_encoder.space_note()
    return inputs, {**input_lineage(inputs.versions), "encoder": encoder, "space": note,
                    "sources_missing": ", ".join(inputs.missing) or "none"}


def build_semantic_duplicates() -> dg.AssetsDefinition:
    @dg.asset(
        name=SEMANTIC_DUPLICATES, group_name="semantic", kinds={"ray", "lance"},
        deps=[dg.AssetDep(IMAGE_EMBEDDINGS, partition_mapping=dg.AllPartitionMapping()),
              dg.AssetDep(PHASHES, partition_mapping=dg.AllPartitionMapping())],
        code_version="1",
        required_resource_keys={"captioner", "image_encoder", "ray_cluster", "sources",
                                "storage"},
        description="SemDeDup across every source: k-means, then pairs above cosine 1 - eps "
                    "within each cluster joined into groups; the copy kept follows the pHash "
                    "dedup (most pixels, source order, id). The rest: skip reason semdedup.")
    def semantic_duplicates_asset(context: dg.AssetExecutionContext,
                                  config: SemanticDuplicatesConfig) -> dg.MaterializeResult:
        sources: SourcesResource = context.resources.sources
        store: Storage = context.resources.storage.get()
        inputs, recorded = _space(context, store, sources.load().names)
        settings = SemDedupConfig(eps=config.eps, report_eps=tuple(config.report_eps),
                                  cluster_rows=config.cluster_rows,
                                  cluster_cap=config.cluster_cap, seed=config.seed)
        image_encoder: ImageEncoderResource = context.resources.image_encoder
        applied = bool(image_encoder.checkpoint) or config.apply_in_caption_space
        out, clusters = store.table(SEMANTIC_DUPLICATES), store.table(SEMANTIC_CLUSTERS)
        result = None if config.refit else incremental_semantic_duplicates(
            inputs, out, clusters, settings, applied, config.sample_rows,
            config.max_changed_share)
        if result is None:
            result = streamed_semantic_duplicates(
                inputs, out, settings,
                Tasks(config.ray_tasks and inputs.rows > config.in_process_rows), applied,
                config.sample_rows, config.chunk_rows, config.bucket_rows,
                clusters_out=clusters)
        removed = result.removed_by_eps[config.eps]
        return dg.MaterializeResult(metadata={
            **recorded, "lance_version": result.version, "embeddings": result.rows,
            "fit_sample": result.sample_rows, "ray_nodes": len(result.nodes),
            "run": result.run, "changed_rows": result.changed_rows,
            "regrouped_rows": result.regrouped_rows, "clusters": result.clusters,
            "largest_cluster": result.largest_cluster,
            "faiss_gpu": result.on_gpu, "eps": config.eps, "removed": removed,
            "applied_by_skip_lists": applied,
            "removed_share": round(removed / result.rows, 4) if result.rows else 0.0,
            "removed_share_by_eps": dg.MetadataValue.md(
                _eps_markdown(result.removed_by_eps, result.rows, config.eps)),
            "largest_groups": _groups_table(result.largest),
        })

    return semantic_duplicates_asset


def _eps_markdown(removed: dict[float, int], rows: int, acting: float) -> str:
    lines = ["| eps | cosine above | removed | share |", "| --- | --- | --- | --- |"]
    for eps, n in sorted(removed.items()):
        mark = " (acting)" if eps == acting else ""
        share = n / rows if rows else 0.0
        lines.append(f"| {eps:g}{mark} | {1 - eps:.2f} | {n} | {share:.2%} |")
    return "\n".join(lines)


def _groups_table(groups: list[dict]) -> dg.TableMetadataValue:
    return dg.MetadataValue.table([dg.TableRecord(g) for g in groups], schema=dg.TableSchema(
        columns=[dg.TableColumn("group_size", "int"), dg.TableColumn("kept_id", "string"),
                 dg.TableColumn("ids", "string")]))


class ConceptsConfig(dg.Config):
    # Clusters per level, leaves first (1 to 4 levels, shrinking upwards).
    level_sizes: list[int] = list(DEFAULT_SIZES)  # noqa: RUF012 (see SkipListsConfig)
    # The balanced sample's size as a share of the samples (the `balance` skip reason
    # leaves out the rest; off by default in the loader).
    target_share: float = DEFAULT_TARGET_SHARE
    # Levels are scaled down together below this many rows per leaf (a small corpus).
    min_rows_per_leaf: int = MIN_ROWS_PER_LEAF
    # The hierarchy is fitted on a seeded sample of at most this many vectors.
    sample_rows: int = DEFAULT_SAMPLE_ROWS
    ray_tasks: bool = True  # assignment and sampling in Ray tasks (False: in this process)
    in_process_rows: int = IN_PROCESS_ROWS  # as SemanticDuplicatesConfig's
    chunk_rows: int = DEFAULT_CHUNK_ROWS  # as SemanticDuplicatesConfig's
    bucket_rows: int = DEFAULT_BUCKET_ROWS
    seed: int = 0
    top_clusters: int = 5
    captions_per_cluster: int = 3
    # New rows are assigned to the recorded hierarchy while their mean cosine to their leaf
    # falls at most `max_drift` below the fit sample's (the drift measure); `refit` (or more
    # drift, deleted rows, other settings) fits the hierarchy again.
    refit: bool = False
    max_drift: float = DEFAULT_MAX_DRIFT


def build_concepts() -> dg.AssetsDefinition:
    @dg.asset(
        name=CONCEPTS, group_name="semantic", kinds={"ray", "lance"}, code_version="1",
        deps=[dg.AssetDep(IMAGE_EMBEDDINGS, partition_mapping=dg.AllPartitionMapping())],
        required_resource_keys={"captioner", "image_encoder", "ray_cluster", "sources",
                                "storage"},
        description="Hierarchical k-means concepts: a cluster per sample per level, and a "
                    "balanced sample (the hierarchical method's water-filling from the top "
                    "level down); the unbalanced rest is the skip reason balance.")
    def concepts(context: dg.AssetExecutionContext, config: ConceptsConfig
                 ) -> dg.MaterializeResult:
        store: Storage = context.resources.storage.get()
        inputs, recorded = _space(context, store, context.resources.sources.load().names)
        rows = inputs.rows
        sizes = effective_sizes(config.level_sizes, max(rows, 1), config.min_rows_per_leaf)
        tag = concepts_tag(inputs, sizes, config.target_share, config.seed, config.sample_rows)
        result = None if config.refit else incremental_concepts(
            inputs, store.table(CONCEPTS), tag, config.seed, config.max_drift)
        if result is None:
            result = streamed_concepts(inputs, store.table(CONCEPTS), sizes,
                                       round(config.target_share * rows), config.seed,
                                       Tasks(config.ray_tasks and rows > config.in_process_rows),
                                       config.captions_per_cluster,
                                       config.sample_rows, config.chunk_rows,
                                       config.bucket_rows, tag=tag)
        if rows == 0:
            return dg.MaterializeResult(metadata={**recorded, "lance_version": result.version,
                                                  "samples": 0})
        before, after = result.sizes[0], result.budgets
        captions = _top_clusters(store, result.first_ids, before, config,
                                 context.resources.captioner.caption_version())
        return dg.MaterializeResult(metadata={
            **recorded, "lance_version": result.version, "samples": rows,
            "fit_sample": result.sample_rows, "ray_nodes": len(result.nodes),
            "run": result.run, "new_rows": result.new_rows,
            "drift": round(result.drift, 5) if result.drift is not None else "refit",
            "level_sizes_used": ", ".join(str(k) for k in sizes),
            "levels": ", ".join(str(int((level > 0).sum())) for level in result.sizes),
            "balanced_samples": int(after.sum()),
            "largest_to_median_before": round(largest_to_median(before), 2),
            "largest_to_median_after": round(largest_to_median(after), 2),
            "leaf_sizes": dg.MetadataValue.md(_histogram_markdown(before, after)),
            "top_clusters": dg.MetadataValue.md(captions),
        })

    return concepts


def _histogram_markdown(before: np.ndarray, after: np.ndarray) -> str:
    """Leaf clusters per size bin, before and after balancing, with text bars (a plot the
    UI renders as it is)."""
    lines = ["| leaf size | clusters before | | clusters after | |",
             "| --- | --- | --- | --- | --- |"]
    edges = sorted({lo for lo, _, _ in size_histogram(before)}
                   | {lo for lo, _, _ in size_histogram(after)})
    top = int(max(before.max(initial=1), 1))
    bounds = [*edges, top + 1]
    for lo, hi in itertools.pairwise(bounds):
        n_before = int(((before >= lo) & (before < hi)).sum())
        n_after = int(((after >= lo) & (after < hi)).sum())
        lines.append(f"| {lo}-{hi - 1} | {n_before} | {'█' * n_before} | {n_after} | "
                     f"{'█' * n_after} |")
    return "\n".join(lines)


def _top_clusters(store: Storage, first_ids: dict[int, list[str]], sizes: np.ndarray,
                  config: ConceptsConfig, caption_version: str) -> str:
    """The largest leaf clusters with a few of their captions (what the concept is)."""
    chosen = np.argsort(-sizes, kind="stable")[:config.top_clusters]
    samples = {int(c): first_ids.get(int(c), []) for c in chosen}
    texts = _captions(store, [i for ids in samples.values() for i in ids], caption_version)
    lines = ["| leaf cluster | size | sample captions |", "| --- | --- | --- |"]
    for cluster, ids in samples.items():
        shown = " / ".join(texts.get(i, i)[:120].replace("|", " ") for i in ids)
        lines.append(f"| {cluster} | {int(sizes[cluster])} | {shown} |")
    return "\n".join(lines)


def _captions(store: Storage, ids: list[str], caption_version: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for source in sorted({i.split(":", 1)[0] for i in ids}):
        table = store.table(CAPTIONS, source)
        if table.latest_version() is None:
            continue
        condition = all_of(active_caption_filter(caption_version),
                           in_filter("id", [i for i in ids if i.startswith(source + ":")]))
        rows = table.to_table(columns=["id", "caption"], filter=condition)
        found.update(zip(rows.column("id").to_pylist(), rows.column("caption").to_pylist(),
                         strict=True))
    return found


def semantic_defs(partitions_def: dg.PartitionsDefinition) -> dg.Definitions:
    return dg.Definitions(assets=[build_image_embeddings(partitions_def),
                                  build_semantic_duplicates(), build_concepts()])
