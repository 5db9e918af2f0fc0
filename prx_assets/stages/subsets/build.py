"""One subset's build: its sources' tables pinned, the selection, its own tree with its card,
and the lineage (the definition's version and every table version read)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from prx_assets.stages.attributes.runs import active_attributes_filter
from prx_assets.stages.labels.labels import active_labels_filter
from prx_assets.stages.shards.card import (
    SHARE_ATTRIBUTES,
    CardFacts,
    build_card,
    concept_coverage,
    provenance_counts,
    value_counts,
    write_card,
)
from prx_assets.stages.subsets.definitions import SubsetDefinition
from prx_assets.stages.subsets.select import Selection, SourceTables, select
from prx_assets.stages.subsets.tree import SubsetTreeReport, build_subset_tree, subset_store
from prx_assets.storage.layout import Storage
from prx_assets.storage.refs import Location
from prx_assets.storage.tables import ATTRIBUTES, CAPTION_LABELS, CONCEPTS, MDS_SAMPLES
from prx_assets.storage.trees import tree_store


@dataclass(frozen=True)
class ActiveVersions:
    """The record versions a subset reads: captions, labels and attributes in use."""

    caption_version: str
    classifier_version: str | None = None
    attribute_version: str | None = None


@dataclass
class SubsetBuild:
    definition: SubsetDefinition
    selection: Selection
    tree: SubsetTreeReport
    inputs: dict[str, int | str | None] = field(default_factory=dict)
    seconds: float = 0.0
    select_seconds: float = 0.0


def source_tables(storage: Storage, sources: list[str], versions: ActiveVersions
                  ) -> tuple[list[SourceTables], dict[str, int | str | None]]:
    """Each source with a current tree, its tables pinned once; and the versions read."""
    tables: list[SourceTables] = []
    read: dict[str, int | str | None] = {}
    for source in sources:
        store = tree_store(storage, source)
        tree_version = store.current_version()
        if tree_version is None:
            continue
        mapping = storage.table(MDS_SAMPLES, source).pinned()
        read[f"mds_shards/{source}"] = tree_version
        read[f"{MDS_SAMPLES}/{source}"] = mapping.version
        labels = _pinned(storage, CAPTION_LABELS, source)
        attributes = _pinned(storage, ATTRIBUTES, source)
        if labels is not None:
            read[f"{CAPTION_LABELS}/{source}"] = labels.version
        if attributes is not None:
            read[f"{ATTRIBUTES}/{source}"] = attributes.version
        tables.append(SourceTables(
            source=source, tree=store.current_tree(), mapping=mapping, labels=labels,
            labels_filter=active_labels_filter(versions.caption_version,
                                               versions.classifier_version)
            if versions.classifier_version else None,
            attributes=attributes if versions.attribute_version else None,
            attributes_filter=active_attributes_filter(versions.caption_version,
                                                       versions.attribute_version)
            if versions.attribute_version else None))
    return tables, read


def _pinned(storage: Storage, name: str, source: str):
    table = storage.table(name, source)
    return table.pinned() if table.exists() else None


def subset_card(definition: SubsetDefinition, selection: Selection,
                report: SubsetTreeReport, tree: Location, licenses: dict[str, str],
                versions: ActiveVersions, inputs: dict, concepts,
                provenance: dict[str, dict[str, int]] | None = None) -> tuple[dict, str]:
    rows = selection.rows
    counts = value_counts(rows, ["label", "origin", *SHARE_ATTRIBUTES])
    facts = CardFacts(
        kind="subset", name=definition.name, tree_version=report.tree_version, uri=str(tree),
        licenses={s: licenses.get(s, "unknown") for s in report.per_source},
        leaves=dict(report.leaves), per_source=dict(report.per_source),
        labels=counts.pop("label", {}), attribute_origins=counts.pop("origin", {}),
        attributes=counts,
        concepts=concept_coverage(concepts, rows.column("id").combine_chunks(),
                                  definition.concept_level) if rows.num_rows else {},
        skips={"skipped_in_sources": selection.dropped.get("skip_lists", 0)},
        versions={k: v for k, v in vars(versions).items() if v},
        inputs=inputs,
        definition={"name": definition.name, "fingerprint": definition.fingerprint(),
                    "description": definition.description, "definition": definition.raw},
        dropped={"candidates": selection.candidates, **selection.dropped},
        provenance=provenance or {})
    return build_card(facts)


def _ids_by_source(rows: pa.Table) -> dict[str, pa.Array]:
    """The selected ids of each source (the selection's `source` column)."""
    ids, sources = rows.column("id").combine_chunks(), rows.column("source").combine_chunks()
    return {s: ids.filter(pc.equal(sources, s)) for s in pc.unique(sources).to_pylist()}


def build_subset(storage: Storage, definition: SubsetDefinition, sources: list[str],
                 licenses: dict[str, str], versions: ActiveVersions,
                 log: Callable[[str], None] | None = None) -> SubsetBuild:
    """Select the subset's samples and publish them as a new version of its tree."""
    started = time.perf_counter()
    tables, inputs = source_tables(storage, sources, versions)
    concepts_table = storage.table(CONCEPTS)
    concepts = concepts_table.pinned() if concepts_table.exists() else None
    if concepts is not None:
        inputs[CONCEPTS] = concepts.version
    selection = select(tables, definition, concepts)
    selected_at = time.perf_counter()
    store = subset_store(storage.mds_root, definition.name, log)
    manifest = {"definition": definition.raw, "definition_version": definition.fingerprint(),
                "inputs": inputs, "versions": vars(versions), "candidates": selection.candidates,
                "dropped": dict(selection.dropped)}

    def card(staging: Location, report: SubsetTreeReport) -> None:
        write_card(staging, *subset_card(definition, selection, report,
                                         store.tree(report.tree_version), licenses, versions,
                                         inputs, concepts,
                                         provenance_counts(storage,
                                                           _ids_by_source(selection.rows))))

    report = build_subset_tree(store, selection.rows, {t.source: t.tree for t in tables},
                               licenses, manifest, write_card=card)
    return SubsetBuild(definition, selection, report, inputs,
                       seconds=time.perf_counter() - started,
                       select_seconds=selected_at - started)


def current_subset_uri(storage: Storage, name: str) -> str:
    """The subset's current tree (what `prx-assets mds-uri --subset NAME` prints)."""
    return str(subset_store(storage.mds_root, name).current_tree())
