"""caption_labels (per source) and the global corpus table, with their checks.

Resources come through required_resource_keys: `captioner` (issue 4's CaptionerResource,
read for its caption_version()), `classifier`, `ray_cluster` (started before the body runs)
and `sources`."""

from collections import Counter
from typing import Optional

import dagster as dg

from prx_assets.s3_captions.captions import active_caption_filter
from prx_assets.s9_corpus.corpus import SourceTables, build_corpus
from prx_assets.s4_labels.labels import LABELS, active_labels_filter, load_embedded_classifier
from prx_assets.s4_labels.runs import label_coverage, label_source
from prx_assets.storage.lance_tables import table_uri
from prx_assets.storage.settings import data_root
from prx_assets.defs.lineage import input_versions, materialized_lance_version
from prx_assets.defs.metadata import counts_table
from prx_assets.defs.resources import ClassifierResource


class CaptionLabelsConfig(dg.Config):
    chunk_rows: int = 4096  # rows committed per Lance merge-insert


def build_caption_labels(partitions_def: dg.PartitionsDefinition) -> dg.AssetsDefinition:
    @dg.asset(
        partitions_def=partitions_def, group_name="captions", deps=["captions"],
        kinds={"ray", "lance"}, code_version="1",
        required_resource_keys={"captioner", "classifier", "ray_cluster"},
        description="Each active caption labelled visual / text / nsfw with its scores and "
                    "its MiniLM embedding; incremental per (caption, classifier) version.")
    def caption_labels(context: dg.AssetExecutionContext, config: CaptionLabelsConfig
                       ) -> dg.MaterializeResult:
        classifier: ClassifierResource = context.resources.classifier
        source = context.partition_key
        caption_version = context.resources.captioner.caption_version()
        captions = table_uri(data_root(), "captions", source)
        labels = table_uri(data_root(), "caption_labels", source)

        def progress(report) -> None:
            context.log.info(f"{report.written + report.failed:,} captions labelled "
                             f"({report.captions_per_s:.1f}/s)")

        caption_filter = active_caption_filter(caption_version)
        report = label_source(captions, labels, caption_version, caption_filter,
                              classifier.spec(), config.chunk_rows, progress)
        coverage = label_coverage(captions, labels, caption_filter, caption_version,
                                  report.classifier_version)
        return dg.MaterializeResult(data_version=dg.DataVersion(
            f"{caption_version}/{report.classifier_version}@{report.lance_version}"), metadata={
            **input_versions(context, "captions"),
            "lance_version": report.lance_version,
            "caption_version": caption_version,
            "classifier_version": report.classifier_version,
            "labelled_now": report.written, "failed_now": report.failed,
            "failures": "; ".join(report.errors) or "none",
            "captions_per_s": round(report.captions_per_s, 2),
            "coverage": round(coverage.share, 4),
            "label_shares": counts_table(Counter({label: coverage.counts.get(label, 0)
                                                  for label in LABELS}), "label"),
            **_validation_metadata(classifier),
        })

    return caption_labels


def _validation_metadata(classifier: ClassifierResource) -> dict:
    """The embedded classifier's per-class validation accuracy, as a table."""
    if classifier.backend != "embedded":
        return {}
    report = load_embedded_classifier().validation
    records = [dg.TableRecord({"label": label, "validation_n": report["all"][label]["n"],
                               "accuracy": report["all"][label]["accuracy"],
                               "hand_written_accuracy": report["hand_written"][label]["accuracy"]})
               for label in LABELS]
    return {"classifier_validation": dg.MetadataValue.table(records, schema=dg.TableSchema(
        columns=[dg.TableColumn("label", "string"), dg.TableColumn("validation_n", "int"),
                 dg.TableColumn("accuracy", "float"),
                 dg.TableColumn("hand_written_accuracy", "float")]))}


class LabelCoverageConfig(dg.Config):
    min_share: float = 1.0


class LabelSharesConfig(dg.Config):
    """Bounds on each label's share; the seeds report a few percent text, a tiny NSFW share."""

    visual_min: float = 0.8
    text_max: float = 0.1
    nsfw_max: float = 0.02


def caption_labels_checks(partitions_def: dg.PartitionsDefinition
                          ) -> list[dg.AssetChecksDefinition]:
    asset = dg.AssetKey("caption_labels")

    def coverage_of(context: dg.AssetCheckExecutionContext):
        classifier: ClassifierResource = context.resources.classifier
        version = context.resources.captioner.caption_version()
        source = context.partition_key
        return label_coverage(table_uri(data_root(), "captions", source),
                              table_uri(data_root(), "caption_labels", source),
                              active_caption_filter(version), version,
                              classifier.classifier_version())

    @dg.asset_check(asset=asset, name="label_coverage", partitions_def=partitions_def,
                    required_resource_keys={"captioner", "classifier"},
                    description="Share of the active caption version's usable captions that "
                                "carry a label under the active classifier version.")
    def label_coverage_check(context: dg.AssetCheckExecutionContext,
                             config: LabelCoverageConfig) -> dg.AssetCheckResult:
        coverage = coverage_of(context)
        return dg.AssetCheckResult(passed=coverage.share >= config.min_share, metadata={
            "coverage": round(coverage.share, 4), "captions": coverage.captions,
            "labelled": coverage.labelled, "min_share": config.min_share})

    @dg.asset_check(asset=asset, name="label_shares", partitions_def=partitions_def,
                    required_resource_keys={"captioner", "classifier"},
                    description="Each label's share inside configurable bounds (warns).")
    def label_shares_check(context: dg.AssetCheckExecutionContext,
                           config: LabelSharesConfig) -> dg.AssetCheckResult:
        shares = coverage_of(context).shares
        outside = [name for name, bad in (("visual", shares["visual"] < config.visual_min),
                                          ("text", shares["text"] > config.text_max),
                                          ("nsfw", shares["nsfw"] > config.nsfw_max)) if bad]
        return dg.AssetCheckResult(
            passed=not outside, severity=dg.AssetCheckSeverity.WARN,
            metadata={**{f"share_{k}": round(v, 4) for k, v in shares.items()},
                      "outside_bounds": ", ".join(outside) or "none",
                      "bounds": f"visual >= {config.visual_min}, text <= {config.text_max}, "
                                f"nsfw <= {config.nsfw_max}"})

    return [label_coverage_check, label_shares_check]


def source_tables(source: str, caption_version: str, classifier_version: str) -> SourceTables:
    root = data_root()
    return SourceTables(source, table_uri(root, "bucketed_images", source),
                        table_uri(root, "captions", source),
                        table_uri(root, "caption_labels", source),
                        table_uri(root, "phashes", source),
                        active_caption_filter(caption_version),
                        active_labels_filter(caption_version, classifier_version))


def build_corpus_asset(partitions_def: dg.PartitionsDefinition) -> dg.AssetsDefinition:
    every_source = dg.AllPartitionMapping()

    @dg.asset(
        group_name="corpus", kinds={"ray", "lance"}, code_version="1",
        deps=[dg.AssetDep(name, partition_mapping=every_source)
              for name in ("bucketed_images", "phashes", "captions", "caption_labels")],
        required_resource_keys={"captioner", "classifier", "ray_cluster", "sources"},
        description="One table across sources for exploration: shape, active caption, label, "
                    "phash, caption embedding and a 256 px thumbnail; full-text, vector and "
                    "scalar indexes (see `prx-assets search` / `similar`).")
    def corpus(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        caption_version = context.resources.captioner.caption_version()
        classifier_version = context.resources.classifier.classifier_version()
        names = [s.name for s in context.resources.sources.load().sources]
        ready = [n for n in names if table_uri(data_root(), "caption_labels", n).exists()]
        if not ready:
            raise dg.Failure("no source has caption_labels yet: materialise them first")
        skipped = sorted(set(names) - set(ready))
        if skipped:
            context.log.warning(f"sources without caption_labels left out: {skipped}")
        uri = table_uri(data_root(), "corpus")
        report = build_corpus(uri, [source_tables(n, caption_version, classifier_version)
                                    for n in ready])
        context.log.info(f"corpus: {report.write.rows:,} rows, indexes {report.indexes}")
        return dg.MaterializeResult(metadata={
            "path": dg.MetadataValue.path(str(uri)),
            "lance_version": lance_version(uri),
            "dagster/row_count": report.write.rows,
            "fragments": report.write.fragments,
            "caption_version": caption_version, "classifier_version": classifier_version,
            "rows_per_source": counts_table(Counter(report.rows_per_source), "source"),
            "indexes": dg.MetadataValue.md("\n".join(
                f"- `{column}`: {kind}" for column, kind in report.indexes.items())),
            "sources_left_out": ", ".join(skipped) or "none",
            **{f"input_version/{asset}/{source}": materialized_lance_version(
                context.instance, dg.AssetKey(asset), source) or -1
               for source in ready for asset in ("captions", "caption_labels")},
        })

    return corpus


def lance_version(uri) -> Optional[int]:
    import lance

    return lance.dataset(str(uri)).version
