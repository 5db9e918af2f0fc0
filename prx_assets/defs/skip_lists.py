"""skip_lists: per-shard sidecars of one source's MDS tree, and the skipped-share check."""

from collections import Counter
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta

import dagster as dg

from prx_assets.defs.asset_leases import asset_lease
from prx_assets.defs.metadata import browser_link, incremental_metadata, input_lineage
from prx_assets.defs.report import funnel_metadata
from prx_assets.defs.resources import (
    CaptionerResource,
    ClassifierResource,
    SourcesResource,
    StorageResource,
)
from prx_assets.stages.opt_outs.guard import pending_opt_outs, pending_rights, recorded_opt_outs
from prx_assets.stages.opt_outs.opt_outs import ids_for_source
from prx_assets.stages.opt_outs.resolution import resolve_opt_outs
from prx_assets.stages.opt_outs.rights import read_rules, withheld_ids, withheld_rows
from prx_assets.stages.report.funnel import source_funnel
from prx_assets.stages.skip_lists.skip_lists import (
    StreamSkips,
    apply_reasons,
    duplicate_ids,
    label_ids,
    mapping_shards,
    read_ablations,
    semantic_duplicate_ids,
    skip_shares,
    unbalanced_ids,
)
from prx_assets.storage.layout import Storage
from prx_assets.storage.refs import TableRef
from prx_assets.storage.sidecars import (
    REASON_BALANCE,
    REASON_DEDUP,
    REASON_OPTOUT,
    REASON_RIGHTS,
    REASON_SEMDEDUP,
    REASON_STALE,
    applies_by_default,
)
from prx_assets.storage.tables import (
    CAPTION_LABELS,
    CONCEPTS,
    DUPLICATES,
    MDS_SAMPLES,
    MDS_SHARDS,
    OPT_OUTS,
    RAW_IMAGES,
    SEMANTIC_DUPLICATES,
    SKIP_LISTS,
)
from prx_assets.storage.trees import tree_store


class SkipListsConfig(dg.Config):
    # Caption labels whose samples are skipped (one reason each). dg.Config is a pydantic
    # model: it copies field defaults per instance, and a ClassVar (what RUF012 asks for)
    # would drop the field from the run config schema.
    skip_labels: list[str] = ["text", "nsfw"]  # noqa: RUF012
    dedup: bool = True
    # Embedding-space duplicates and the concept-balance complement, when their global
    # tables exist. Written to the sidecars; a training run picks them (the loader leaves
    # `balance` out unless named).
    semdedup: bool = True
    balance: bool = True
    opt_outs: bool = True
    # Training reservations (docs/rights.md): prohibited, on a reserved domain, or
    # constrained and not cleared by a curator.
    rights: bool = True
    # Named ablation lists: $PRX_DATA_ROOT/ablations/<name>.txt, one id per line.
    ablations: bool = True


def build_skip_lists_asset(partitions_def: dg.PartitionsDefinition) -> dg.AssetsDefinition:
    """Label reasons use the active caption and classifier versions of the resources."""

    @dg.asset(
        partitions_def=partitions_def,
        name=SKIP_LISTS,
        deps=[MDS_SHARDS, DUPLICATES, CAPTION_LABELS, OPT_OUTS, SEMANTIC_DUPLICATES, CONCEPTS],
        group_name="dedup",
        kinds={"json"},
        description="Per-shard skip lists (shard.NNNNN.skip.json beside each shard): "
                    "non-kept duplicates (pHash and semantic), the concept-balance "
                    "complement, chosen caption labels, opt-outs, rights reservations and named "
                    "ablations. Shards are never touched.",
    )
    def skip_lists(context: dg.AssetExecutionContext, config: SkipListsConfig,
                   sources: SourcesResource, captioner: CaptionerResource,
                   classifier: ClassifierResource, storage: StorageResource
                   ) -> dg.MaterializeResult:
        source = context.partition_key
        store = storage.get()
        with asset_lease(context, store):
            mapping = store.table(MDS_SAMPLES, source)
            mapping_version = mapping.latest_version()
            if mapping_version is None:
                raise dg.Failure(f"{mapping} does not exist: materialise mds_shards for {source}")
            versions = (captioner.caption_version(), classifier.classifier_version())
            reasons, lineage = _reasons(context, config, store, source, sources.load().names,
                                        versions)
            # The mapping is read under the tree lease, with the lists built from it and
            # published: the lists and the lineage are one version of it.
            run = apply_reasons(store, source, reasons)
            report, per_leaf, tree = run.report, run.per_leaf, run.tree
            mapping_version = run.mapping.version
            context.log.info(f"{source}: {report.written} sidecar(s) written, {report.removed} "
                             f"removed, {report.unchanged} unchanged under {tree}")
            lineage.update(input_lineage({MDS_SAMPLES: mapping_version}))
            total = sum(per_leaf.values()) + report.skipped_per_reason.get(REASON_STALE, 0)
            return dg.MaterializeResult(metadata={
                **lineage, "tree": dg.MetadataValue.path(str(tree)),
                # Skipped as the loader skips when a run names no reasons; the opt-in
                # lists are in skipped_per_reason, marked so.
                "samples": total, "skipped": report.skipped_by_default,
                "skipped_share": round(report.skipped_by_default / total, 4) if total else 0.0,
                "skipped_per_reason": _reason_table(report.skipped_per_reason, total),
                "sidecars_written": report.written, "sidecars_removed": report.removed,
                "sidecars_unchanged": report.unchanged, **browser_link(context),
                # The last per-source asset: where this source's images went, end to end.
                **funnel_metadata(source_funnel(store, source, *versions)),
                # A skip list removes nothing stored: its work is the samples whose skip state
                # changed; every other sample is carried as it was.
                **incremental_metadata(report.samples_changed, total - report.samples_changed, 0),
            })

    return skip_lists


def _reasons(context: dg.AssetExecutionContext, config: SkipListsConfig, store: Storage,
             source: str, all_sources: list[str], versions: tuple[str, str]
             ) -> tuple[dict[str, set[str]], dict]:
    """The ids each reason removes from this source, and the input versions read."""
    reasons: dict[str, set[str]] = {}
    lineage: dict = {}
    duplicates = _pinned_if_exists(store.table(DUPLICATES)) if config.dedup else None
    if duplicates is not None:
        reasons[REASON_DEDUP] = duplicate_ids(duplicates, source)
        lineage.update(input_lineage({DUPLICATES: duplicates.version}))
    semantic = _pinned_if_exists(store.table(SEMANTIC_DUPLICATES)) if config.semdedup else None
    if semantic is not None:
        reasons[REASON_SEMDEDUP] = semantic_duplicate_ids(semantic, source)
        lineage.update(input_lineage({SEMANTIC_DUPLICATES: semantic.version}))
    concepts = _pinned_if_exists(store.table(CONCEPTS)) if config.balance else None
    if concepts is not None:
        reasons[REASON_BALANCE] = unbalanced_ids(concepts, source)
        lineage.update(input_lineage({CONCEPTS: concepts.version}))
    labels = _pinned_if_exists(store.table(CAPTION_LABELS, source)) if config.skip_labels \
        else None
    if labels is not None:
        reasons.update(label_ids(labels, config.skip_labels, *versions))
        lineage.update(input_lineage({CAPTION_LABELS: labels.version}))
        lineage["caption_version"], lineage["classifier_version"] = versions
    elif config.skip_labels:
        context.log.warning(f"{source}: no caption_labels table yet; label reasons not applied")
    if config.opt_outs:
        resolution = resolve_opt_outs(store, all_sources)
        reasons[REASON_OPTOUT] = ids_for_source(resolution.audit, source)
        lineage["opt_out_requests"] = resolution.requests
        lineage["opt_out_malformed_rows"] = len(resolution.errors)
    if config.rights:
        raw = _pinned_if_exists(store.table(RAW_IMAGES, source))
        if raw is not None:
            withheld = {w.id for w in withheld_rows(raw, read_rules(store))}
            if withheld:  # an absent reason is an empty list: no sidecar names it
                reasons[REASON_RIGHTS] = withheld
            lineage.update(input_lineage({RAW_IMAGES: raw.version}))
    if config.ablations:
        for name, ids in read_ablations(store.ablations_dir).items():
            reasons[name] = {i for i in ids if i.startswith(f"{source}:")}
    return reasons, lineage


def _pinned_if_exists(table: TableRef) -> TableRef | None:
    """The table at its latest version (what is read and recorded), None if never written."""
    version = table.latest_version()
    return None if version is None else table.at(version)


def _applied(reason: str) -> str:
    return "by default" if applies_by_default(reason) else "opt-in (when a run names it)"


def _reason_table(counts: Mapping[str, int], total: int, counted: str = "skipped"
                  ) -> dg.TableMetadataValue:
    """Per reason: samples (`counted`), their share of `total`, and whether the loader
    applies the reason by default or only when a run names it."""
    records = [dg.TableRecord({"reason": reason, counted: int(n),
                               "share": round(n / total, 4) if total else 0.0,
                               "applied": _applied(reason)})
               for reason, n in sorted(counts.items())]
    return dg.MetadataValue.table(records, schema=dg.TableSchema(columns=[
        dg.TableColumn("reason", "string"), dg.TableColumn(counted, "int"),
        dg.TableColumn("share", "float"), dg.TableColumn("applied", "string")]))


class SkipShareConfig(dg.Config):
    warn_above: float = 0.10


def skip_share_warning(source: str, records: list, over: list[str], bound: float
                       ) -> str | None:
    """What the warning measured, per stream over the bound: "512/640x480 2 of 9 (22%)"."""
    if not over:
        return None
    shown = [f"{r.data['stream']} {r.data['skipped']} of {r.data['samples']} "
             f"({r.data['share']:.0%})" for r in records if r.data["stream"] in over]
    more = f" and {len(shown) - 5} more" if len(shown) > 5 else ""
    return (f"rewrite recommended for {source}: {len(over)} stream(s) skip more than "
            f"{bound:.0%} of their samples: {', '.join(shown[:5])}{more} (run the rewrite job; "
            f"opt-in lists such as balance are not counted: the loader skips them only when "
            f"a run names them)")


def _counts_words(counts: Mapping[str, int]) -> str:
    """"dedup 2, semdedup 1" (largest first), "" for none."""
    return ", ".join(f"{reason} {n}" for reason, n in
                     sorted(counts.items(), key=lambda item: (-item[1], item[0])) if n)


def _stream_table(shares: Mapping[str, StreamSkips]) -> list[dg.TableRecord]:
    return [dg.TableRecord({"stream": leaf, "samples": s.samples, "skipped": s.skips.skipped,
                            "share": round(s.share, 4),
                            "reasons": _counts_words(s.skips.by_reason),
                            "opt_in": _counts_words(s.skips.opt_in)})
            for leaf, s in shares.items()]


def _per_reason_table(shares: Mapping[str, StreamSkips]) -> dg.TableMetadataValue:
    """Per reason across the source: samples it lists, their share of the stored samples,
    and whether the loader applies it by default or only when a run names it."""
    total = sum(s.samples for s in shares.values())
    counts: Counter = Counter()
    for s in shares.values():
        counts.update(s.skips.by_reason)
        counts.update(s.skips.opt_in)
    return _reason_table(counts, total, counted="samples")


def skipped_share_check(partitions_def: dg.PartitionsDefinition) -> dg.AssetChecksDefinition:
    @dg.asset_check(asset=dg.AssetKey(SKIP_LISTS), name="skipped_share",
                    partitions_def=partitions_def,
                    description="Share of samples the loader skips by default per stream (MDS "
                                "leaf), read back from the sidecars; above the bound a rewrite "
                                "of the source is recommended (skipping is free to change, but "
                                "wastes I/O). Opt-in lists (balance, ablations) are counted "
                                "apart: the loader applies them only when a run names them.")
    def skipped_share(context: dg.AssetCheckExecutionContext, config: SkipShareConfig,
                      storage: StorageResource) -> dg.AssetCheckResult:
        source, store = context.partition_key, storage.get()
        _, per_leaf = mapping_shards(store.table(MDS_SAMPLES, source))
        shares = skip_shares(tree_store(store, source).current_tree(), per_leaf)
        records = _stream_table(shares)
        over = [leaf for leaf, s in shares.items() if s.share > config.warn_above]
        over_by_reason: Counter = Counter()
        for leaf in over:
            over_by_reason.update(shares[leaf].skips.by_reason)
        return dg.AssetCheckResult(
            passed=not over, severity=dg.AssetCheckSeverity.WARN,
            description=skip_share_warning(source, records, over, config.warn_above),
            metadata={"warn_above": config.warn_above,
                      "streams_over": ", ".join(over) or "none",
                      # What tripped the warning: samples per reason in the streams over.
                      "over_by_reason": dg.MetadataValue.json(dict(sorted(
                          over_by_reason.items()))),
                      "per_reason": _per_reason_table(shares),
                      "per_stream": dg.MetadataValue.table(records, schema=dg.TableSchema(
                          columns=[dg.TableColumn("stream", "string"),
                                   dg.TableColumn("samples", "int"),
                                   dg.TableColumn("skipped", "int"),
                                   dg.TableColumn("share", "float"),
                                   dg.TableColumn("reasons", "string"),
                                   dg.TableColumn("opt_in", "string")]))})

    return skipped_share


class OptOutsAppliedConfig(dg.Config):
    # How long an opt-out may take to reach the sidecars of the current tree (a sensor
    # tick plus a skip_lists run) before the tree counts as leaking it.
    delay_hours: float = 1.0


def opt_outs_applied_check(partitions_def: dg.PartitionsDefinition
                           ) -> dg.AssetChecksDefinition:
    @dg.asset_check(asset=dg.AssetKey(SKIP_LISTS), name="opt_outs_applied",
                    partitions_def=partitions_def, blocking=True,
                    description="Fails when an opt-out recorded more than `delay_hours` ago, "
                                "or a sample withheld for its rights (docs/rights.md), is "
                                "still streamable from the source's current tree (its "
                                "shard's sidecar does not skip it); metadata names the "
                                "oldest pending opt-out and the first reserved sample.")
    def opt_outs_applied(context: dg.AssetCheckExecutionContext, config: OptOutsAppliedConfig,
                         storage: StorageResource) -> dg.AssetCheckResult:
        source, store = context.partition_key, storage.get()
        now = datetime.now(UTC)
        pending = pending_opt_outs(store, source, recorded_opt_outs(store),
                                   now - timedelta(hours=config.delay_hours))
        reserved = pending_rights(store, source, withheld_ids(store, [source]))
        metadata: dict = {"pending": len(pending), "delay_hours": config.delay_hours,
                          "pending_rights": len(reserved)}
        if reserved:
            withheld, place = reserved[0]
            metadata.update({"first_reserved_id": place.id,
                             "first_reserved_signal": f"{withheld.status}: {withheld.signal}"})
        if pending:
            oldest = pending[0]
            metadata.update({
                "oldest_pending_id": oldest.place.id,
                "oldest_pending_request": oldest.opted.request_id,
                "oldest_pending_requested_at": oldest.opted.requested_at.isoformat(),
                "oldest_pending_hours": round(
                    (now - oldest.opted.requested_at).total_seconds() / 3600, 2)})
        problems = []
        if pending:
            problems.append(f"{len(pending)} opt-out(s) older than {config.delay_hours} h "
                            f"still streamable from {source}'s current tree; the oldest: "
                            f"{pending[0].place.id} ({pending[0].opted.request_id})")
        if reserved:
            problems.append(f"{len(reserved)} sample(s) withheld for their rights still "
                            f"streamable from {source}'s current tree; the first: "
                            f"{reserved[0][1].id} ({reserved[0][0].status})")
        return dg.AssetCheckResult(passed=not problems, metadata=metadata,
                                   description="; ".join(problems) or None)

    return opt_outs_applied


def skip_list_defs(partitions_def: dg.PartitionsDefinition) -> dg.Definitions:
    return dg.Definitions(assets=[build_skip_lists_asset(partitions_def)],
                          asset_checks=[skipped_share_check(partitions_def),
                                        opt_outs_applied_check(partitions_def)])
