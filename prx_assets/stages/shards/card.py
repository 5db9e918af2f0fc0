"""The card of a published tree: `card.json` and `card.md` beside its manifest, written into
the staging tree in the same publish (a source's tree by `publish.write_manifest`, a subset's
by its build), so a tree and its card are current together.

`build_card(facts)` is pure: the facts in, the JSON document and its Markdown out. The
gatherers read the facts: a tree's leaves and skip sidecars, the label and attribute shares
of the records the tree's samples carry, the concept coverage, the input versions.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from prx_assets.storage.refs import Location, TableRef

CARD_JSON = "card.json"
CARD_MD = "card.md"
CARD_VERSION = 1
# Attributes a card summarises as shares (the enum and boolean ones; qualities as histograms).
SHARE_ATTRIBUTES = ("medium", "subjects", "people", "visible_text", "watermark", "setting",
                    "lighting", "composition", "style", "technical_quality",
                    "aesthetic_quality")


@dataclass
class CardFacts:
    """What a card says about one tree."""

    kind: str  # "source" or "subset"
    name: str
    tree_version: str
    uri: str  # where the tree is published (what `prx-assets mds-uri` prints)
    licenses: dict[str, str]  # source -> license
    leaves: dict[str, int]  # "<tier>/<W>x<H>" -> samples
    per_source: dict[str, int] = field(default_factory=dict)
    labels: dict[str, int] = field(default_factory=dict)
    attributes: dict[str, dict[str, int]] = field(default_factory=dict)
    attribute_origins: dict[str, int] = field(default_factory=dict)
    concepts: dict[str, Any] = field(default_factory=dict)  # level, clusters, covered, samples
    skips: dict[str, int] = field(default_factory=dict)  # reason -> samples skipped
    versions: dict[str, str] = field(default_factory=dict)  # caption, classifier, attribute
    inputs: dict[str, int | str | None] = field(default_factory=dict)  # table -> version
    definition: dict[str, Any] = field(default_factory=dict)  # a subset's definition
    dropped: dict[str, int] = field(default_factory=dict)  # a subset's selection figures
    # Samples per license, per attribution-required license and per reservation
    # (`provenance_counts`; docs/rights.md).
    provenance: dict[str, dict[str, int]] = field(default_factory=dict)


def build_card(facts: CardFacts, now: datetime | None = None) -> tuple[dict, str]:
    """The card as a JSON document and as Markdown."""
    samples = sum(facts.leaves.values())
    per_tier: Counter = Counter()
    for leaf, n in facts.leaves.items():
        per_tier[leaf.split("/")[0]] += n
    card = {
        "card_version": CARD_VERSION, "kind": facts.kind, "name": facts.name,
        "tree_version": facts.tree_version, "uri": facts.uri,
        "created_at": (now or datetime.now(UTC)).isoformat(timespec="seconds"),
        "samples": samples,
        "sources": [{"name": s, "license": facts.licenses.get(s, "unknown"),
                     "samples": facts.per_source.get(s)} for s in sorted(facts.licenses)],
        "tiers": {tier: per_tier[tier] for tier in sorted(per_tier, key=int)},
        "shapes": dict(sorted(facts.leaves.items())),
        "labels": _shares(facts.labels),
        "attributes": {name: _shares(counts) for name, counts in facts.attributes.items()},
        "attribute_origins": dict(facts.attribute_origins),
        "concepts": dict(facts.concepts),
        "skips": dict(sorted(facts.skips.items())),
        "licenses": _shares(facts.provenance.get("license", {})),
        "attribution_required": _shares(facts.provenance.get("attribution_required", {})),
        "reservations": _shares(facts.provenance.get("reservation", {})),
        "versions": dict(sorted(facts.versions.items())),
        "inputs": dict(sorted(facts.inputs.items())),
        "stream": stream_recipe(facts),
    }
    if facts.definition:
        card["definition"] = facts.definition
        card["selection"] = dict(sorted(facts.dropped.items()))
    return card, card_markdown(card)


def _shares(counts: Mapping[str, int]) -> dict[str, dict[str, float | int]]:
    total = sum(counts.values())
    return {str(k): {"count": int(n), "share": round(n / total, 4) if total else 0.0}
            for k, n in sorted(counts.items(), key=lambda kv: (-kv[1], str(kv[0])))}


def stream_recipe(facts: CardFacts) -> dict[str, str]:
    flag = f"--subset {facts.name}" if facts.kind == "subset" else facts.name
    weight_key = f"subset:{facts.name}" if facts.kind == "subset" else facts.name
    leaf = sorted(facts.leaves)[0] if facts.leaves else "<tier>/<W>x<H>"
    return {
        "uri": f"prx-assets mds-uri {flag}",
        "streaming": ("from streaming import StreamingDataset\n"
                      f"ds = StreamingDataset(remote=\"$(prx-assets mds-uri {flag})/{leaf}\", "
                      "local=\"/tmp/cache\")"),
        "loader": ("from prx_assets.loader import build_loader\n"
                   f"loader = build_loader(None, tier={leaf.split('/')[0]}, batch_size=32, "
                   f"weights={{{weight_key!r}: 1.0}})"),
    }


def card_markdown(card: dict) -> str:
    lines = [f"# {card['kind']} tree `{card['name']}`", "",
             f"Version `{card['tree_version']}`, {card['samples']:,} samples, written "
             f"{card['created_at']}.", ""]
    if card.get("definition"):
        d = card["definition"]
        lines += [f"Subset definition `{d.get('name')}` version `{d.get('fingerprint')}`: "
                  f"{d.get('description') or 'no description'}.", ""]
    lines += ["## Sources and licenses", "", "| source | license | samples |",
              "| --- | --- | ---: |"]
    lines += [f"| {s['name']} | {s['license']} | {_n(s['samples'])} |" for s in card["sources"]]
    lines += _provenance_lines(card)
    lines += ["", "## Tiers and shapes", "", "| leaf | samples |", "| --- | ---: |"]
    lines += [f"| {leaf} | {n:,} |" for leaf, n in card["shapes"].items()]
    lines += _share_section("Caption labels", {"label": card["labels"]})
    lines += _share_section("Attributes", card["attributes"])
    if card["attribute_origins"]:
        origins = ", ".join(f"{k}: {v:,}" for k, v in card["attribute_origins"].items())
        lines += ["", f"Attribute records by origin: {origins}."]
    lines += ["", "## Concepts", ""]
    c = card["concepts"]
    lines.append(f"{c.get('covered', 0)} of {c.get('clusters', 0)} concept clusters at level "
                 f"{c.get('level', '-')} present; {c.get('samples', 0):,} samples carry one."
                 if c else "No concepts table.")
    lines += ["", "## Dedup and skips", ""]
    lines += [skip_line(reason, n) for reason, n in card["skips"].items()] or ["- none"]
    if card.get("selection"):
        lines += ["", "## Selection", ""]
        selection = dict(card["selection"])
        if "candidates" in selection:
            lines.append(f"- candidates: {selection.pop('candidates'):,}")
        lines += [f"- dropped by {k}: {v:,}" for k, v in selection.items()] \
            or ["- nothing dropped"]
    lines += ["", "## Versions", ""]
    lines += [f"- {k}: `{v}`" for k, v in card["versions"].items()]
    lines += [f"- input {k}: `{v}`" for k, v in card["inputs"].items()]
    stream = card["stream"]
    lines += ["", "## How to stream it", "", f"`{stream['uri']}` prints the tree's URI.", "",
              "```python", stream["streaming"], "```", "", "```python", stream["loader"],
              "```", ""]
    return "\n".join(lines)


def _provenance_lines(card: dict) -> list[str]:
    """Samples per license (those asking for attribution marked) and per reservation."""
    if not card.get("licenses") and not card.get("reservations"):
        return []
    asks = card.get("attribution_required", {})
    lines = ["", "## Provenance and reservations", "", "| license | samples | attribution |",
             "| --- | ---: | --- |"]
    lines += [f"| {name} | {v['count']:,} | {'required' if name in asks else '-'} |"
              for name, v in card.get("licenses", {}).items()]
    reservations = ", ".join(f"{name}: {v['count']:,}"
                             for name, v in card.get("reservations", {}).items())
    lines += ["", f"Training reservations (read at ingest; reserved samples are skipped as "
                  f"`rights`): {reservations or 'none recorded'}."]
    return lines


def attribution_required(license: str) -> bool:
    """Whether a license identifier is one that asks for attribution (the CC BY family, and
    any name saying `attribution`)."""
    name = license.lower().replace("_", "-").replace(" ", "-")
    return name.startswith(("cc-by", "by-")) or name == "by" or "attribution" in name


def provenance_counts(storage: Any, ids_by_source: Mapping[str, pa.Array]
                      ) -> dict[str, dict[str, int]]:
    """Samples per license, per attribution-required license and per reservation, of the
    given ids of each source (their raw_images rows; a table of an older schema counts
    nothing)."""
    from prx_assets.storage.tables import RAW_IMAGES

    totals: dict[str, Counter] = {"license": Counter(), "reservation": Counter()}
    for source, ids in ids_by_source.items():
        raw = storage.table(RAW_IMAGES, source)
        if not raw.exists() or "reservation" not in raw.open().schema.names:
            continue
        rows = raw.to_table(columns=["id", "license", "reservation"])
        rows = rows.filter(pc.is_in(rows.column("id"), value_set=ids))
        for column, counts in value_counts(rows, ["license", "reservation"]).items():
            totals[column].update(counts)
    out = {name: dict(counts) for name, counts in totals.items() if counts}
    asks = {k: n for k, n in totals["license"].items() if attribution_required(k)}
    if asks:
        out["attribution_required"] = asks
    return out


def _n(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def _share_section(title: str, groups: Mapping[str, Mapping[str, Mapping[str, Any]]]
                   ) -> list[str]:
    lines = ["", f"## {title}", ""]
    if not any(groups.values()):
        return [*lines, "None recorded."]
    for name, shares in groups.items():
        if not shares:  # e.g. the qualities of caption-derived records
            lines.append(f"- {name}: not recorded")
            continue
        parts = ", ".join(f"{value} {s['share']:.0%}" for value, s in shares.items())
        lines.append(f"- {name}: {parts}")
    return lines


def write_card(folder: Location, card: dict, markdown: str) -> None:
    """Both files into a (staging) tree folder."""
    (folder / CARD_JSON).write_text(json.dumps(card, indent=2, sort_keys=True, default=str))
    (folder / CARD_MD).write_text(markdown)


def read_card(tree: Location) -> dict | None:
    try:
        return json.loads((tree / CARD_JSON).read_text())
    except FileNotFoundError:
        return None


# --- gathering ---------------------------------------------------------------------------

def leaf_counts(tree: Location) -> dict[str, int]:
    """Samples per leaf, from the tree's index files."""
    from prx_assets.storage.trees import leaf_names, leaf_samples

    return {name: leaf_samples(tree / name) for name in leaf_names(tree)}


def skip_line(reason: str, samples: int) -> str:
    """"- dedup: 12", or "- balance: 45 (opt-in list: skipped only when a run names it)"."""
    from prx_assets.storage.sidecars import applies_by_default

    note = "" if applies_by_default(reason) else \
        " (opt-in list: skipped only when a run names it)"
    return f"- {reason}: {samples:,}{note}"


def skip_counts(tree: Location) -> dict[str, int]:
    """Samples skipped per reason across the tree's sidecars."""
    from prx_assets.storage.sidecars import SIDECAR_SUFFIX, read_sidecar
    from prx_assets.storage.trees import leaf_names

    counts: Counter = Counter()
    for name in leaf_names(tree):
        for sidecar in (tree / name).files(SIDECAR_SUFFIX):
            for reason, ids in read_sidecar(sidecar).items():
                counts[reason] += len(ids)
    return dict(counts)


def value_counts(rows: pa.Table, columns: Iterable[str]) -> dict[str, dict[str, int]]:
    """Per column, how many rows hold each value (list columns: each item counts)."""
    out: dict[str, dict[str, int]] = {}
    for name in columns:
        if name not in rows.column_names:
            continue
        column = rows.column(name)
        if pa.types.is_list(column.type):
            column = pc.list_flatten(column.combine_chunks())
        counts = pc.value_counts(pc.drop_null(column))
        out[name] = {_key(v["values"].as_py()): int(v["counts"].as_py()) for v in counts}
    return out


def _key(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def dominant_version(table: TableRef, column: str, filter: str | None = None) -> str | None:
    """The value of `column` most rows carry (the version in use), None when empty."""
    if not table.exists():
        return None
    values = table.to_table(columns=[column], filter=filter).column(column)
    if len(values) == 0:
        return None
    counts = pc.value_counts(values)
    best = max(counts, key=lambda v: v["counts"].as_py())
    return str(best["values"].as_py())


def concept_coverage(concepts: TableRef | None, ids: pa.Array, level: int = 1
                     ) -> dict[str, Any]:
    """How many clusters at `level` the samples touch, of how many there are."""
    if concepts is None or not concepts.exists():
        return {}
    table = concepts.to_table(columns=["id", "cluster"], filter=f"level = {int(level)}")
    if table.num_rows == 0:
        return {}
    mine = table.filter(pc.is_in(table.column("id"), value_set=ids))
    return {"level": level, "clusters": len(pc.unique(table.column("cluster"))),
            "covered": len(pc.unique(mine.column("cluster"))), "samples": mine.num_rows}


def source_licenses(names: Iterable[str]) -> dict[str, str]:
    """Each source's `license` from the sources file ("unknown" where it has none, or
    where the sources file cannot be read from here)."""
    from prx_assets.stages.ingest.sources import SourcesError, load_sources

    names = list(names)
    try:
        known = {s.name: s.license for s in load_sources().sources}
    except SourcesError:
        known = {}
    return {name: known.get(name, "unknown") for name in names}


def record_facts(storage: Any, source: str, ids: pa.Array, caption_version: str | None
                 ) -> tuple[dict[str, dict[str, int]], dict[str, str], dict[str, int | None]]:
    """Label and attribute value counts of `ids` under the versions in use (the ones most
    of the caption version's rows carry), the versions, and the tables' versions read."""
    from prx_assets.stages.attributes.runs import active_attributes_filter
    from prx_assets.storage.filters import all_of, eq_filter
    from prx_assets.storage.tables import ATTRIBUTES, CAPTION_LABELS

    counts: dict[str, dict[str, int]] = {}
    versions: dict[str, str] = {}
    inputs: dict[str, int | None] = {}
    if caption_version is None:
        return counts, versions, inputs
    by_caption = eq_filter("caption_version", caption_version)
    labels = storage.table(CAPTION_LABELS, source).pinned() \
        if storage.table(CAPTION_LABELS, source).exists() else None
    if labels is not None:
        inputs[CAPTION_LABELS] = labels.version
        classifier = dominant_version(labels, "classifier_version", by_caption)
        if classifier:
            versions["classifier_version"] = classifier
            rows = labels.to_table(columns=["id", "label"], filter=all_of(
                by_caption, eq_filter("classifier_version", classifier)))
            rows = rows.filter(pc.is_in(rows.column("id"), value_set=ids))
            counts["labels"] = value_counts(rows, ["label"]).get("label", {})
    attributes = storage.table(ATTRIBUTES, source).pinned() \
        if storage.table(ATTRIBUTES, source).exists() else None
    if attributes is not None:
        inputs[ATTRIBUTES] = attributes.version
        version = dominant_version(attributes, "attribute_version", by_caption)
        if version:
            versions["attribute_version"] = version
            rows = attributes.to_table(
                columns=["id", "origin", *SHARE_ATTRIBUTES],
                filter=active_attributes_filter(caption_version, version))
            rows = rows.filter(pc.is_in(rows.column("id"), value_set=ids))
            counts.update(value_counts(rows, SHARE_ATTRIBUTES))
            counts["__origin__"] = value_counts(rows, ["origin"]).get("origin", {})
    return counts, versions, inputs


def source_tree_card(build: Any) -> tuple[dict, str]:
    """The card of a source tree being built (`shards.plan.Build`), from its staging
    folder and the tables it was planned from."""
    from prx_assets.storage.layout import Storage
    from prx_assets.storage.tables import BUCKETED_IMAGES, CAPTIONS, CONCEPTS

    storage = Storage.above(build.store.mds_root)
    inputs = build.inputs
    ids = inputs.captions.to_table(columns=["id"], filter=inputs.caption_filter) \
        .column("id").combine_chunks()
    caption_version = dominant_version(inputs.captions, "caption_version",
                                       inputs.caption_filter)
    counts, versions, read = record_facts(storage, build.source, ids, caption_version)
    origins = counts.pop("__origin__", {})
    labels = counts.pop("labels", {})
    leaves = leaf_counts(build.staging)
    facts = CardFacts(
        kind="source", name=build.source, tree_version=build.version,
        uri=str(build.store.tree(build.version)),
        licenses=source_licenses([build.source]), leaves=leaves,
        per_source={build.source: sum(leaves.values())}, labels=labels,
        attributes=counts, attribute_origins=origins,
        concepts=concept_coverage(storage.table(CONCEPTS), ids),
        skips=skip_counts(build.staging),
        provenance=provenance_counts(storage, {build.source: ids}),
        versions={**versions, **({"caption_version": caption_version}
                                 if caption_version else {})},
        inputs={BUCKETED_IMAGES: inputs.bucketed.version, CAPTIONS: inputs.captions.version,
                **read})
    return build_card(facts)


def write_source_card(build: Any) -> None:
    """card.json and card.md into the staging tree of a source build (before its manifest,
    so a complete version always has its card)."""
    write_card(build.staging, *source_tree_card(build))
