"""caption_labels: each source's active captions labelled visual / text / nsfw, with checks.

Resources come through required_resource_keys: `captioner` (read for its caption_version()),
`classifier`, `ray_cluster` (started before the body runs) and `storage`."""

from collections import Counter

import dagster as dg

from prx_assets.defs.asset_leases import asset_lease
from prx_assets.defs.executor import MODEL_STEP_TAG
from prx_assets.defs.metadata import counts_table, pin_inputs, stage_result
from prx_assets.defs.report import cost_metadata
from prx_assets.defs.resources import ClassifierResource
from prx_assets.engine.progress import StageProgress
from prx_assets.stages.captions.captions import active_caption_filter
from prx_assets.stages.labels.labels import LABELS, load_embedded_classifier
from prx_assets.stages.labels.runs import label_coverage, label_shares, label_source
from prx_assets.storage.tables import CAPTION_LABELS, CAPTIONS


class CaptionLabelsConfig(dg.Config):
    chunk_rows: int = 4096  # rows committed per Lance merge-insert


def build_caption_labels(partitions_def: dg.PartitionsDefinition) -> dg.AssetsDefinition:
    @dg.asset(
        name=CAPTION_LABELS, partitions_def=partitions_def, group_name="captions",
        op_tags={MODEL_STEP_TAG: "true"},
        deps=[CAPTIONS], kinds={"ray", "lance"}, code_version="1",
        required_resource_keys={"captioner", "classifier", "ray_cluster", "storage"},
        description="Each active caption labelled visual / text / nsfw with its scores and "
                    "its MiniLM embedding; incremental per (caption, classifier) version.")
    def caption_labels(context: dg.AssetExecutionContext, config: CaptionLabelsConfig
                       ) -> dg.MaterializeResult:
        classifier: ClassifierResource = context.resources.classifier
        source = context.partition_key
        caption_version = context.resources.captioner.caption_version()
        store = context.resources.storage.get()
        with asset_lease(context, store):
            inputs = pin_inputs(store, source, CAPTIONS)
            captions, labels = inputs[CAPTIONS], store.table(CAPTION_LABELS, source)
            # The total is counted inside label_source (pending captions): set with the first
            # chunk; a run with nothing pending ends on "nothing to do".
            progress = StageProgress(f"{CAPTION_LABELS}[{source}]", None, context.log.info,
                                     unit="captions")
            caption_filter = active_caption_filter(caption_version)
            report = label_source(captions, labels, caption_version, caption_filter,
                                  classifier.spec(), config.chunk_rows,
                                  lambda r: progress.update(r.commits.rows, total=r.to_do))
            progress.total = report.to_do
            progress.finish()
            coverage = label_coverage(captions, labels, caption_filter, caption_version,
                                      report.classifier_version)
            # Labels are replaced in place (keyed per caption and classifier version); those
            # of items gone upstream are dropped. A failed row is not written: not processed.
            return stage_result(
                context, inputs=inputs, lance_version=report.lance_version,
                processed=report.written, reused=max(0, coverage.rows() - report.written),
                removed=report.removed, seconds=report.seconds,
                data_version=dg.DataVersion(f"{caption_version}/{report.classifier_version}"
                                            f"@{report.lance_version}"),
                metadata={
                    "caption_version": caption_version,
                    "classifier_version": report.classifier_version,
                    "labelled_now": report.written, "failed_now": report.failed,
                    "failures": "; ".join(report.examples) or "none",
                    "captions_per_s": round(report.captions_per_s, 2),
                    **cost_metadata(report.seconds, report.commits.rows, classifier.gpus(),
                                    classifier.gpu_hour_usd, classifier.cpu_hour_usd),
                    "coverage": round(coverage.share(), 4),
                    "label_shares": counts_table(Counter({label: coverage.rows(label)
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
    """Bounds on each label's share; the reference pipeline saw a few percent text and a tiny
    NSFW share."""

    visual_min: float = 0.8
    text_max: float = 0.1
    nsfw_max: float = 0.02


def label_bounds_missed(shares: dict[str, float], config: LabelSharesConfig) -> list[str]:
    """Each label outside its bound, as the warning says it: "text 14% > bound 10%"."""
    missed = []
    for name, share, bound, low in (("visual", shares["visual"], config.visual_min, True),
                                    ("text", shares["text"], config.text_max, False),
                                    ("nsfw", shares["nsfw"], config.nsfw_max, False)):
        if (share < bound) if low else (share > bound):
            missed.append(f"{name} {share:.1%} {'<' if low else '>'} bound {bound:.0%}")
    return missed


def caption_labels_checks(partitions_def: dg.PartitionsDefinition
                          ) -> list[dg.AssetChecksDefinition]:
    asset = dg.AssetKey(CAPTION_LABELS)

    def coverage_of(context: dg.AssetCheckExecutionContext):
        classifier: ClassifierResource = context.resources.classifier
        version = context.resources.captioner.caption_version()
        source, store = context.partition_key, context.resources.storage.get()
        return label_coverage(store.table(CAPTIONS, source), store.table(CAPTION_LABELS, source),
                              active_caption_filter(version), version,
                              classifier.classifier_version())

    @dg.asset_check(asset=asset, name="label_coverage", partitions_def=partitions_def,
                    required_resource_keys={"captioner", "classifier", "storage"},
                    description="Share of the active caption version's usable captions that "
                                "carry a label under the active classifier version.")
    def label_coverage_check(context: dg.AssetCheckExecutionContext,
                             config: LabelCoverageConfig) -> dg.AssetCheckResult:
        coverage = coverage_of(context)
        return dg.AssetCheckResult(passed=coverage.share() >= config.min_share, metadata={
            "coverage": round(coverage.share(), 4), "captions": coverage.inputs,
            "labelled": coverage.rows(), "min_share": config.min_share})

    @dg.asset_check(asset=asset, name="label_shares", partitions_def=partitions_def,
                    required_resource_keys={"captioner", "classifier", "storage"},
                    description="Each label's share inside configurable bounds (warns).")
    def label_shares_check(context: dg.AssetCheckExecutionContext,
                           config: LabelSharesConfig) -> dg.AssetCheckResult:
        shares = label_shares(coverage_of(context))
        outside = label_bounds_missed(shares, config)
        return dg.AssetCheckResult(
            passed=not outside, severity=dg.AssetCheckSeverity.WARN,
            description=("; ".join(outside) + " of the labelled captions") if outside else None,
            metadata={**{f"share_{k}": round(v, 4) for k, v in shares.items()},
                      "outside_bounds": ", ".join(o.split(" ")[0] for o in outside) or "none",
                      "bounds": f"visual >= {config.visual_min}, text <= {config.text_max}, "
                                f"nsfw <= {config.nsfw_max}"})

    return [label_coverage_check, label_shares_check]


def label_defs(partitions_def: dg.PartitionsDefinition) -> dg.Definitions:
    return dg.Definitions(assets=[build_caption_labels(partitions_def)],
                          asset_checks=caption_labels_checks(partitions_def))
