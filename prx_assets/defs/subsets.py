"""subsets: one partition per subset of `subsets.yaml`, each published as its own MDS tree
(`mds/subsets/<name>`) with its card, lineage to the definition's version and to every
table version it read."""


from pathlib import Path

import dagster as dg

from prx_assets.defs.asset_leases import asset_lease
from prx_assets.defs.metadata import INPUT_VERSION, counts_table
from prx_assets.defs.report import duration_metadata
from prx_assets.stages.subsets.build import ActiveVersions, build_subset
from prx_assets.stages.subsets.definitions import load_subsets
from prx_assets.storage.tables import (
    ATTRIBUTES,
    CAPTION_LABELS,
    CONCEPTS,
    MDS_SHARDS,
    SKIP_LISTS,
    SUBSETS,
)

SUBSETS_GROUP = "subsets"  # the corpus jobs leave it out: its partitions are subsets


def build_subsets_asset(partitions_def: dg.StaticPartitionsDefinition, subsets_file: Path
                        ) -> dg.AssetsDefinition:
    @dg.asset(
        name=SUBSETS, partitions_def=partitions_def, group_name=SUBSETS_GROUP,
        deps=[MDS_SHARDS, SKIP_LISTS, ATTRIBUTES, CAPTION_LABELS, CONCEPTS], kinds={"mds"},
        required_resource_keys={"captioner", "classifier", "attributer", "storage",
                                "sources"},
        description="A named fine-tuning subset of subsets.yaml (one partition each): its "
                    "samples selected by attributes, labels, tiers, sources and concepts, "
                    "capped and cut to size, copied into its own MDS tree with its card.")
    def subsets(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        definition = load_subsets(subsets_file).get(context.partition_key)
        sources = context.resources.sources.load()
        versions = ActiveVersions(
            caption_version=context.resources.captioner.caption_version(),
            classifier_version=context.resources.classifier.classifier_version(),
            attribute_version=context.resources.attributer.attribute_version())
        store = context.resources.storage.get()
        with asset_lease(context, store):  # one writer per subset, like a source's tree
            built = build_subset(store, definition, sources.names,
                                 {s.name: s.license for s in sources.sources}, versions,
                                 context.log.info)
        tree = built.tree
        context.log.info(f"subset {definition.name!r}: {tree.samples:,} samples from "
                         f"{built.selection.candidates:,} candidates, tree {tree.tree_version}")
        return dg.MaterializeResult(
            data_version=dg.DataVersion(f"{definition.fingerprint()}@{tree.tree_version}"),
            metadata={
                "definition_version": definition.fingerprint(),
                "tree_version": tree.tree_version,
                "path": dg.MetadataValue.path(tree.path),
                "samples": tree.samples, "candidates": built.selection.candidates,
                "bytes": tree.bytes,
                "per_source": counts_table(tree.per_source, "source"),
                "dropped": counts_table(built.selection.dropped, "reason"),
                # Its inputs include tree versions (strings): recorded as they are.
                **{f"{INPUT_VERSION}{name}": value for name, value in built.inputs.items()},
                **{k: v for k, v in vars(versions).items() if v},
                **duration_metadata("stage_seconds", built.seconds),
                "select_seconds": round(built.select_seconds, 3),
                "dagster/row_count": tree.samples,
            })

    return subsets


def subset_defs(subsets_file: Path) -> dg.Definitions:
    """The subsets asset, when the subsets file defines any."""
    names = load_subsets(subsets_file).names
    if not names:
        return dg.Definitions()
    partitions = dg.StaticPartitionsDefinition(names)
    asset = build_subsets_asset(partitions, subsets_file)
    job = dg.define_asset_job("subsets_job", selection=dg.AssetSelection.assets(asset),
                              partitions_def=partitions,
                              description="Build one subset's tree (after skip_lists_job).")
    return dg.Definitions(assets=[asset], jobs=[job])
