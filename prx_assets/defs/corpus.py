"""corpus: one table across every source for exploration and search, built in its own job.

Incremental per source: a source whose input versions (bucketed_images, phashes, captions,
caption_labels, attributes) are those the last corpus materialisation recorded keeps its
rows; of the others, the rows that differ are rewritten (their thumbnails kept while the
image is unchanged), and the indexes updated. A new caption or classifier version updates
every source and retrains the indexes. The corpus is written whole only when there is none
yet, it is empty, or its schema changed.
"""

from collections import Counter

import dagster as dg

from prx_assets.defs.asset_leases import asset_lease
from prx_assets.defs.metadata import (
    INPUT_VERSION,
    browser_link,
    content_data_version,
    counts_table,
    incremental_metadata,
    latest_data_version,
    latest_materialization,
    recorded,
)
from prx_assets.engine.progress import StageProgress
from prx_assets.stages.attributes.runs import active_attributes_filter
from prx_assets.stages.captions.captions import active_caption_filter
from prx_assets.stages.corpus.corpus import (
    CORPUS_SCHEMA,
    SourceTables,
    build_corpus,
    index_config,
    update_corpus,
)
from prx_assets.stages.labels.labels import active_labels_filter
from prx_assets.stages.shards.card import dominant_version
from prx_assets.storage.filters import eq_filter
from prx_assets.storage.layout import Storage
from prx_assets.storage.tables import (
    ATTRIBUTES,
    BUCKETED_IMAGES,
    CAPTION_LABELS,
    CAPTIONS,
    CORPUS,
    PHASHES,
    RAW_IMAGES,
)

INPUTS = (BUCKETED_IMAGES, PHASHES, CAPTIONS, CAPTION_LABELS, ATTRIBUTES, RAW_IMAGES)


def source_tables(store: Storage, source: str, caption_version: str,
                  classifier_version: str) -> SourceTables:
    """A source's inputs pinned at their latest versions: what is read is what is recorded."""
    attribute_table = store.table(ATTRIBUTES, source)
    attributes = attribute_table.pinned() if attribute_table.exists() else None
    # The attribute version in use: the one most of this caption version's records carry.
    attribute_version = dominant_version(attributes, "attribute_version",
                                         eq_filter("caption_version", caption_version)) \
        if attributes is not None else None
    return SourceTables(
        source, store.table(BUCKETED_IMAGES, source), store.table(CAPTIONS, source),
        store.table(CAPTION_LABELS, source), store.table(PHASHES, source),
        active_caption_filter(caption_version),
        active_labels_filter(caption_version, classifier_version),
        attributes if attribute_version else None,
        active_attributes_filter(caption_version, attribute_version)
        if attribute_version else None, store.table(RAW_IMAGES, source)).pinned()


def pinned_versions(tables: SourceTables) -> dict:
    """Metadata entries `input_version/<table>/<source>` of exactly the versions read."""
    versions = {BUCKETED_IMAGES: tables.bucketed.version, CAPTIONS: tables.captions.version,
                CAPTION_LABELS: tables.labels.version, PHASHES: tables.phashes.version}
    if tables.attributes is not None:
        versions[ATTRIBUTES] = tables.attributes.version
    if tables.raw is not None:
        versions[RAW_IMAGES] = tables.raw.version
    return {f"{INPUT_VERSION}{table}/{tables.name}": -1 if v is None else v
            for table, v in versions.items()}


def recorded_sources(previous: dg.AssetMaterialization | None) -> set[str]:
    """The sources the previous materialisation read (named by its input-version entries);
    none without one."""
    if previous is None:
        return set()
    return {key.rsplit("/", 1)[1] for key in previous.metadata
            if key.startswith(INPUT_VERSION) and key.count("/") == 2}


def changed_since(previous: dg.AssetMaterialization | None, tables: SourceTables) -> bool:
    """Whether any input version of the source differs from what `previous` recorded (all
    of them without a previous materialisation)."""
    return any(recorded(previous, key) != version
               for key, version in pinned_versions(tables).items())


def full_rebuild_reason(previous: dg.AssetMaterialization | None, store: Storage) -> str | None:
    """Why the corpus is written whole, or None when an update per source will do."""
    if previous is None or not store.table(CORPUS).exists():
        return "no corpus yet"
    if not store.table(CORPUS).open().get_fragments():
        return "the corpus is empty"  # a replacement needs a fragment to commit against
    if store.table(CORPUS).open().schema != CORPUS_SCHEMA:
        return "the corpus schema changed"
    return None


def every_row_reason(previous: dg.AssetMaterialization | None, caption_version: str,
                     classifier_version: str) -> str | None:
    """Why every source's rows may all change (a new caption or classifier version): each
    source is updated, its thumbnails kept, and the indexes are retrained."""
    for entry, now in (("caption_version", caption_version),
                       ("classifier_version", classifier_version)):
        if recorded(previous, entry) != now:
            return f"{entry.replace('_', ' ')} changed"
    return None


def build_corpus_asset(partitions_def: dg.PartitionsDefinition) -> dg.AssetsDefinition:
    every_source = dg.AllPartitionMapping()

    @dg.asset(
        name=CORPUS, group_name="corpus", kinds={"ray", "lance"}, code_version="2",
        deps=[dg.AssetDep(name, partition_mapping=every_source) for name in INPUTS],
        required_resource_keys={"captioner", "classifier", "ray_cluster", "sources", "storage"},
        description="One table across sources for exploration: shape, active caption, label, "
                    "phash, caption embedding and a 256 px thumbnail; full-text, vector and "
                    "scalar indexes (see `prx-assets search` / `similar`). Rebuilt per "
                    "changed source, its indexes updated rather than retrained.")
    def corpus(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        caption_version = context.resources.captioner.caption_version()
        classifier_version = context.resources.classifier.classifier_version()
        store: Storage = context.resources.storage.get()
        with asset_lease(context, store):
            names = [s.name for s in context.resources.sources.load().sources]
            ready = [n for n in names if store.table(CAPTION_LABELS, n).exists()]
            if not ready:
                raise dg.Failure("no source has caption_labels yet: materialise them first")
            skipped = sorted(set(names) - set(ready))
            if skipped:
                context.log.warning(f"sources without caption_labels left out: {skipped}")
            tables = [source_tables(store, n, caption_version, classifier_version) for n in ready]
            corpus_table = store.table(CORPUS)
            previous = latest_materialization(context.instance, CORPUS, None)
            reason = full_rebuild_reason(previous, store)
            every_row = every_row_reason(previous, caption_version, classifier_version)
            changed = tables if reason or every_row else \
                [t for t in tables if changed_since(previous, t)]
            # Rows per source are known only once joined with the labels: no total. A full
            # build is one Ray write (no chunks to count): its closing line only.
            progress = StageProgress(CORPUS, None, context.log.info)
            if reason:
                context.log.info(f"corpus: full rebuild ({reason})")
                report = build_corpus(corpus_table, tables)
                progress.update(report.write.rows)
            else:
                gone = sorted(recorded_sources(previous) - set(ready))
                keep = [t.name for t in tables if t not in changed]
                context.log.info(f"corpus: updating {[t.name for t in changed]}"
                                 f"{f' ({every_row})' if every_row else ''}, removing {gone}, "
                                 f"keeping {keep}")
                report = update_corpus(
                    corpus_table, changed, gone, keep,
                    rebuild_indexes=bool(every_row)
                    or recorded(previous, "index_config") != index_config(),
                    on_rows=progress.advance)
            progress.finish()
            indexes = ", ".join(f"{column} {kind}" for column, kind in report.indexes.items())
            context.log.info(f"corpus: {report.write.rows:,} rows; indexes: {indexes}")
            lance_version = corpus_table.latest_version()
            changed_rows = bool(report.processed or report.removed)
            return dg.MaterializeResult(metadata={
                "path": dg.MetadataValue.path(corpus_table.uri),
                "lance_version": lance_version,
                "dagster/row_count": report.write.rows,
                "fragments": report.write.fragments,
                "caption_version": caption_version, "classifier_version": classifier_version,
                **incremental_metadata(report.processed,
                                       max(0, report.write.rows - report.processed),
                                       report.removed),
                "full_rebuild": reason or "no",
                "sources_replaced": ", ".join(t.name for t in changed) or "none",
                "rows_per_source": counts_table(Counter(report.rows_per_source), "source"),
                "rows_written_per_source": counts_table(Counter(report.inserted), "source"),
                "rows_deleted_per_source": counts_table(Counter(report.deleted), "source"),
                "index_config": index_config(),
                "indexes": dg.MetadataValue.md("\n".join(
                    f"- `{column}`: {kind}" for column, kind in report.indexes.items())),
                "sources_left_out": ", ".join(skipped) or "none", **browser_link(context),
                **{k: v for t in tables for k, v in pinned_versions(t).items()},
            }, data_version=content_data_version(
                latest_data_version(context.instance, CORPUS, None), changed_rows,
                lance_version))

    return corpus


def corpus_defs(partitions_def: dg.PartitionsDefinition) -> dg.Definitions:
    # Its job, corpus_table_job, comes from the registry (`definitions.pipeline_jobs`).
    return dg.Definitions(assets=[build_corpus_asset(partitions_def)])
