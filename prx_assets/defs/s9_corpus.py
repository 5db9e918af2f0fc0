"""corpus: one table across every source for exploration and search, built in its own job."""

from collections import Counter

import dagster as dg

from prx_assets.s3_captions.captions import active_caption_filter
from prx_assets.s4_labels.labels import active_labels_filter
from prx_assets.s9_corpus.corpus import SourceTables, build_corpus
from prx_assets.storage.layout import Storage
from prx_assets.storage.tables import (
    BUCKETED_IMAGES, CAPTION_LABELS, CAPTIONS, CORPUS, PHASHES)
from prx_assets.defs.metadata import browser_link, counts_table

INPUTS = (BUCKETED_IMAGES, PHASHES, CAPTIONS, CAPTION_LABELS)


def source_tables(store: Storage, source: str, caption_version: str,
                  classifier_version: str) -> SourceTables:
    """A source's inputs pinned at their latest versions: what is read is what is recorded."""
    return SourceTables(
        source, store.table(BUCKETED_IMAGES, source), store.table(CAPTIONS, source),
        store.table(CAPTION_LABELS, source), store.table(PHASHES, source),
        active_caption_filter(caption_version),
        active_labels_filter(caption_version, classifier_version),
        bucketed_version=store.latest_version(BUCKETED_IMAGES, source),
        captions_version=store.latest_version(CAPTIONS, source),
        labels_version=store.latest_version(CAPTION_LABELS, source),
        phashes_version=store.latest_version(PHASHES, source))


def pinned_versions(tables: SourceTables) -> dict:
    """Metadata entries `input_version/<table>/<source>` of exactly the versions read."""
    versions = {BUCKETED_IMAGES: tables.bucketed_version, CAPTIONS: tables.captions_version,
                CAPTION_LABELS: tables.labels_version, PHASHES: tables.phashes_version}
    return {f"input_version/{table}/{tables.name}": -1 if v is None else v
            for table, v in versions.items()}


def build_corpus_asset(partitions_def: dg.PartitionsDefinition) -> dg.AssetsDefinition:
    every_source = dg.AllPartitionMapping()

    @dg.asset(
        name=CORPUS, group_name="corpus", kinds={"ray", "lance"}, code_version="1",
        deps=[dg.AssetDep(name, partition_mapping=every_source) for name in INPUTS],
        required_resource_keys={"captioner", "classifier", "ray_cluster", "sources", "storage"},
        description="One table across sources for exploration: shape, active caption, label, "
                    "phash, caption embedding and a 256 px thumbnail; full-text, vector and "
                    "scalar indexes (see `prx-assets search` / `similar`).")
    def corpus(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        caption_version = context.resources.captioner.caption_version()
        classifier_version = context.resources.classifier.classifier_version()
        store: Storage = context.resources.storage.get()
        names = [s.name for s in context.resources.sources.load().sources]
        ready = [n for n in names if store.exists(CAPTION_LABELS, n)]
        if not ready:
            raise dg.Failure("no source has caption_labels yet: materialise them first")
        skipped = sorted(set(names) - set(ready))
        if skipped:
            context.log.warning(f"sources without caption_labels left out: {skipped}")
        tables = [source_tables(store, n, caption_version, classifier_version) for n in ready]
        uri = store.table(CORPUS)
        report = build_corpus(uri, tables)
        context.log.info(f"corpus: {report.write.rows:,} rows, indexes {report.indexes}")
        return dg.MaterializeResult(metadata={
            "path": dg.MetadataValue.path(str(uri)),
            "lance_version": store.latest_version(CORPUS),
            "dagster/row_count": report.write.rows,
            "fragments": report.write.fragments,
            "caption_version": caption_version, "classifier_version": classifier_version,
            "rows_per_source": counts_table(Counter(report.rows_per_source), "source"),
            "indexes": dg.MetadataValue.md("\n".join(
                f"- `{column}`: {kind}" for column, kind in report.indexes.items())),
            "sources_left_out": ", ".join(skipped) or "none", **browser_link(context),
            **{k: v for t in tables for k, v in pinned_versions(t).items()},
        })

    return corpus


def corpus_defs(partitions_def: dg.PartitionsDefinition) -> dg.Definitions:
    corpus = build_corpus_asset(partitions_def)
    return dg.Definitions(assets=[corpus], jobs=[dg.define_asset_job(
        "corpus_table_job", selection=dg.AssetSelection.assets(corpus),
        description="The searchable corpus table across sources.")])
