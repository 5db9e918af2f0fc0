"""skip_lists: per-shard sidecars of one source's MDS tree, and the skipped-share check."""

from pathlib import Path

import dagster as dg
import lance

from prx_assets.storage.lance_tables import table_uri
from prx_assets.s7_shards.mds import current_tree
from prx_assets.s6_opt_outs.opt_outs import ids_for_source, opt_out_dir, parse_directory, resolve
from prx_assets.storage.settings import data_root
from prx_assets.s8_skip_lists.skip_lists import (
    REASON_DEDUP, REASON_OPTOUT, apply_skip_lists, build_skip_lists,
    duplicate_ids, label_ids, mapping_batches, mapping_shards, read_ablations, skip_shares)
from prx_assets.defs.resources import CaptionerResource, ClassifierResource, SourcesResource

MAPPING_TABLE = "mds_samples"  # issue 6's id -> (leaf, shard, sample_index) table


class SkipListsConfig(dg.Config):
    # Caption labels whose samples are skipped (one reason each).
    skip_labels: list[str] = ["text", "nsfw"]
    dedup: bool = True
    opt_outs: bool = True
    # Named ablation lists: $PRX_DATA_ROOT/ablations/<name>.txt, one id per line.
    ablations: bool = True


def build_skip_lists_asset(partitions_def: dg.PartitionsDefinition) -> dg.AssetsDefinition:
    """Label reasons use the active caption and classifier versions of the resources."""

    @dg.asset(
        partitions_def=partitions_def,
        deps=["mds_shards", "duplicates", "caption_labels", "opt_outs"],
        group_name="dedup",
        kinds={"json"},
        description="Per-shard skip lists (shard.NNNNN.skip.json beside each shard): "
                    "non-kept duplicates, chosen caption labels, opt-outs and named "
                    "ablations. Shards are never touched.",
    )
    def skip_lists(context: dg.AssetExecutionContext, config: SkipListsConfig,
                   sources: SourcesResource, captioner: CaptionerResource,
                   classifier: ClassifierResource) -> dg.MaterializeResult:
        source = context.partition_key
        root = data_root()
        mapping = table_uri(root, MAPPING_TABLE, source)
        if not mapping.exists():
            raise dg.Failure(f"{mapping} does not exist: materialise mds_shards for {source}")
        versions = (captioner.caption_version(), classifier.classifier_version())
        reasons, lineage = _reasons(context, config, root, source, sources.load().names,
                                    versions)
        shards, per_leaf = mapping_shards(mapping)
        lists = build_skip_lists(mapping_batches(mapping), reasons)
        tree = current_tree(root, source)
        report = apply_skip_lists(tree, lists, shards)
        context.log.info(f"{source}: {report.written} sidecar(s) written, {report.removed} "
                         f"removed, {report.unchanged} unchanged under {tree}")
        lineage[f"input_version/{MAPPING_TABLE}"] = lance.dataset(str(mapping)).version
        total = sum(per_leaf.values())
        return dg.MaterializeResult(metadata={
            **lineage, "tree": dg.MetadataValue.path(str(tree)),
            "samples": total, "skipped": report.skipped_total,
            "skipped_share": round(report.skipped_total / total, 4) if total else 0.0,
            "skipped_per_reason": _reason_table(report.skipped_per_reason, total),
            "sidecars_written": report.written, "sidecars_removed": report.removed,
            "sidecars_unchanged": report.unchanged,
        })

    return skip_lists


def _reasons(context: dg.AssetExecutionContext, config: SkipListsConfig, root: Path,
             source: str, all_sources: list[str], versions: tuple[str, str]
             ) -> tuple[dict[str, set[str]], dict]:
    """The ids each reason removes from this source, and the input versions read."""
    reasons: dict[str, set[str]] = {}
    lineage: dict = {}
    duplicates = table_uri(root, "duplicates")
    if config.dedup and duplicates.exists():
        reasons[REASON_DEDUP] = duplicate_ids(duplicates, source)
        lineage["input_version/duplicates"] = lance.dataset(str(duplicates)).version
    labels = table_uri(root, "caption_labels", source)
    if config.skip_labels and labels.exists():
        reasons.update(label_ids(labels, config.skip_labels, *versions))
        lineage["input_version/caption_labels"] = lance.dataset(str(labels)).version
        lineage["caption_version"], lineage["classifier_version"] = versions
    elif config.skip_labels:
        context.log.warning(f"{source}: no caption_labels table yet; label reasons not applied")
    if config.opt_outs:
        parsed = parse_directory(opt_out_dir(root))
        audit = resolve(parsed.requests, all_sources, root)
        reasons[REASON_OPTOUT] = ids_for_source(audit, source)
        lineage["opt_out_requests"] = len(parsed.requests)
        lineage["opt_out_malformed_rows"] = len(parsed.errors)
    if config.ablations:
        for name, ids in read_ablations(root / "ablations").items():
            reasons[name] = {i for i in ids if i.startswith(f"{source}:")}
    return reasons, lineage


def _reason_table(counts, total: int) -> dg.TableMetadataValue:
    records = [dg.TableRecord({"reason": reason, "skipped": int(n),
                               "share": round(n / total, 4) if total else 0.0})
               for reason, n in sorted(counts.items())]
    return dg.MetadataValue.table(records, schema=dg.TableSchema(columns=[
        dg.TableColumn("reason", "string"), dg.TableColumn("skipped", "int"),
        dg.TableColumn("share", "float")]))


class SkipShareConfig(dg.Config):
    warn_above: float = 0.10


def skipped_share_check(partitions_def: dg.PartitionsDefinition) -> dg.AssetChecksDefinition:
    @dg.asset_check(asset=dg.AssetKey("skip_lists"), name="skipped_share",
                    partitions_def=partitions_def,
                    description="Share of skipped samples per stream (MDS leaf), read back from "
                                "the sidecars; above the bound a rewrite of the source is "
                                "recommended (skipping is free to change, but wastes I/O).")
    def skipped_share(context: dg.AssetCheckExecutionContext,
                      config: SkipShareConfig) -> dg.AssetCheckResult:
        source = context.partition_key
        shards, per_leaf = mapping_shards(table_uri(data_root(), MAPPING_TABLE, source))
        shares = skip_shares(current_tree(data_root(), source), per_leaf, shards)
        records = [dg.TableRecord({"stream": leaf, "samples": n, "skipped": k,
                                   "share": round(k / n, 4) if n else 0.0})
                   for leaf, (n, k) in shares.items()]
        over = [r.data["stream"] for r in records if r.data["share"] > config.warn_above]
        return dg.AssetCheckResult(
            passed=not over, severity=dg.AssetCheckSeverity.WARN,
            description=(f"rewrite recommended for {source}: streams {', '.join(over)} skip more "
                         f"than {config.warn_above:.0%} (run the rewrite job)") if over else None,
            metadata={"warn_above": config.warn_above,
                      "streams_over": ", ".join(over) or "none",
                      "per_stream": dg.MetadataValue.table(records, schema=dg.TableSchema(
                          columns=[dg.TableColumn("stream", "string"),
                                   dg.TableColumn("samples", "int"),
                                   dg.TableColumn("skipped", "int"),
                                   dg.TableColumn("share", "float")]))})

    return skipped_share
