"""Subsets over two small sources' trees: the definitions file, the selection (attributes,
labels, tiers, skip lists, caps, target), the subset's own tree (bytes as stored, the
license per sample, streamable as it is), and the card beside every tree's manifest."""

import dataclasses
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from prx_assets.stages.attributes.schema import STATUS_OK, Tagged, attribute_rows
from prx_assets.stages.labels.labels import label_rows
from prx_assets.stages.shards import mds, plan
from prx_assets.stages.shards.card import CARD_JSON, CARD_MD, read_card
from prx_assets.stages.subsets.build import ActiveVersions, build_subset, current_subset_uri
from prx_assets.stages.subsets.definitions import SubsetsError, load_subsets, parse_subset
from prx_assets.stages.subsets.select import condition_mask
from prx_assets.storage.lance_tables import overwrite_rows
from prx_assets.storage.layout import Storage
from prx_assets.storage.sidecars import sidecar_body, sidecar_name
from prx_assets.storage.tables import ATTRIBUTES, CAPTION_LABELS, MDS_SAMPLES
from prx_assets.storage.trees import current_tree, leaf_names
from prx_assets.testing.mds_corpus import ACTIVE, build_corpus, inputs_for
from prx_assets.testing.shared_memory import plain_dataset

VERSIONS = ActiveVersions(ACTIVE, "clf-1", "attr-1")
LICENSES = {"web": "cc-by-4.0", "lake": "internal"}


def write_records(storage: Storage, source: str, ids: list[str]) -> None:
    """Labels and attributes: every third id is text-heavy, every other one a painting."""
    labels = ["text" if i % 3 == 0 else "visual" for i in range(len(ids))]
    n = len(ids)
    overwrite_rows(storage.table(CAPTION_LABELS, source), table := label_rows(
        ids, [ACTIVE] * n, "clf-1", labels, np.zeros((n, 3), np.float32),
        np.zeros((n, 384), np.float32)), table.schema)
    tagged = [Tagged(i, ACTIVE, {"medium": "painting" if k % 2 else "photo",
                                 "subjects": ["animal"], "visible_text": "none",
                                 "watermark": k % 5 == 0, "aesthetic_quality": 1 + k % 5},
                     STATUS_OK, "caption_derived") for k, i in enumerate(ids)]
    overwrite_rows(storage.table(ATTRIBUTES, source), rows := attribute_rows(tagged, "attr-1"),
                   rows.schema)


@pytest.fixture()
def two_trees(data_root):
    storage = Storage(str(data_root))
    for seed, source in enumerate(("web", "lake")):
        build_corpus(data_root, source, per_shape=6, seed=seed)
        inputs = dataclasses.replace(inputs_for(data_root, source), license=LICENSES[source])
        mds.write_mds_tree(inputs, data_root, source,
                           plan.WriteOptions(size_limit=60_000, parallel=False))
        ids = sorted(storage.table(MDS_SAMPLES, source).to_table(columns=["id"])
                     .column("id").to_pylist())
        write_records(storage, source, ids)
    return storage


def test_every_source_tree_has_a_card_beside_its_manifest(two_trees, data_root):
    tree = current_tree(data_root, "web")
    card = json.loads((tree / CARD_JSON).read_text())
    assert card["kind"] == "source" and card["name"] == "web"
    assert card["samples"] == sum(card["shapes"].values()) > 0
    assert set(card["tiers"]) == {"1", "2"}
    assert card["versions"]["caption_version"] == ACTIVE
    assert set(card["inputs"]) >= {"bucketed_images", "captions"}
    assert "prx-assets mds-uri web" in card["stream"]["uri"]
    markdown = (tree / CARD_MD).read_text()
    assert markdown.startswith("# source tree `web`") and "## How to stream it" in markdown


def test_definitions_are_validated_on_load(tmp_path):
    with pytest.raises(SubsetsError, match=r"attributes\.medium"):
        parse_subset({"name": "x", "attributes": {"medium": ["hologram"]}})
    with pytest.raises(SubsetsError, match="unknown field"):
        parse_subset({"name": "x", "colour": "red"})
    with pytest.raises(SubsetsError, match="name"):
        parse_subset({"name": "Bad Name"})
    path = tmp_path / "subsets.yaml"
    path.write_text("subsets:\n  - {name: a, target_size: 5}\n  - {name: a}\n")
    with pytest.raises(SubsetsError, match="repeated"):
        load_subsets(path)
    assert load_subsets(tmp_path / "missing.yaml").names == []
    one = parse_subset({"name": "a", "attributes": {"aesthetic_quality": {"min": 3}}})
    other = parse_subset({"name": "a", "attributes": {"aesthetic_quality": {"min": 4}}})
    assert one.fingerprint() != other.fingerprint() and one.fingerprint().startswith("1-")


def test_a_subset_is_its_own_streamable_tree_with_lineage_and_a_card(two_trees, data_root):
    storage = two_trees
    web_tree = current_tree(data_root, "web")
    mapping = storage.table(MDS_SAMPLES, "web").to_table().to_pylist()
    # One web sample skipped as a duplicate: a subset never carries it.
    skipped = next(r for r in mapping if r["tier"] == 1)
    (web_tree / skipped["leaf"] / sidecar_name(skipped["shard"])).write_text(
        sidecar_body({"dedup": [skipped["sample_index"]]}))
    definition = parse_subset({
        "name": "photos", "labels": ["visual"], "tiers": [1],
        "attributes": {"medium": ["photo"], "watermark": False,
                       "aesthetic_quality": {"min": 2}},
        "cap_per_source": 100, "target_size": 1000})
    built = build_subset(storage, definition, ["web", "lake"], LICENSES, VERSIONS)

    rows = built.selection.rows.to_pylist()
    assert rows and all(r["label"] == "visual" and r["medium"] == "photo"
                        and not r["watermark"] and r["aesthetic_quality"] >= 2
                        and r["tier"] == 1 for r in rows)
    assert skipped["id"] not in {r["id"] for r in rows}
    assert built.selection.dropped["skip_lists"] == 1
    uri = current_subset_uri(storage, "photos")
    assert uri == built.tree.path and "/mds/subsets/" in uri
    tree = Path(uri)
    assert leaf_names(storage.mds_root / "subsets" / "photos") == sorted(built.tree.leaves)

    # Streamed as it is: the stored JPEG bytes unchanged, the source's license per sample.
    stored = {}
    for source in ("web", "lake"):
        for leaf in leaf_names(storage.mds_root / source):
            ds = plain_dataset(local=str(current_tree(data_root, source) / leaf),
                                  shuffle=False, batch_size=1)
            stored.update({s["id"]: s["image"].fp.getvalue() for s in ds})
            assert {s["license"] for s in ds} == {LICENSES[source]}  # carried per sample
    seen = {}
    for leaf in built.tree.leaves:
        for sample in plain_dataset(local=str(tree / leaf), shuffle=False, batch_size=1):
            seen[sample["id"]] = sample
    assert set(seen) == {r["id"] for r in rows}
    for sample_id, sample in seen.items():
        assert sample["image"].fp.getvalue() == stored[sample_id]
        assert sample["license"] == LICENSES[sample["source"]]

    manifest = json.loads((tree / "tree.json").read_text())
    assert manifest["definition_version"] == definition.fingerprint()
    assert manifest["inputs"]["mds_samples/web"] == storage.table(MDS_SAMPLES, "web") \
        .latest_version()
    assert {"attributes/lake", "caption_labels/web", "mds_shards/web"} <= set(manifest["inputs"])
    card = read_card(storage.mds_root / "subsets" / "photos")
    assert card["kind"] == "subset" and card["samples"] == len(rows)
    assert {s["name"]: s["license"] for s in card["sources"]} == \
        {s: LICENSES[s] for s in built.tree.per_source}
    assert card["attributes"]["medium"] == {"photo": {"count": len(rows), "share": 1.0}}
    assert card["selection"]["skip_lists"] == 1
    assert "--subset photos" in (tree / CARD_MD).read_text()


def test_caps_and_the_target_keep_a_stable_ranked_sample(two_trees):
    base = {"name": "small", "tiers": [1, 2]}
    capped = build_subset(two_trees, parse_subset({**base, "cap_per_source": 5}),
                          ["web", "lake"], LICENSES, VERSIONS)
    assert dict(capped.tree.per_source) == {"web": 5, "lake": 5}
    three = build_subset(two_trees, parse_subset({**base, "target_size": 3}),
                         ["web", "lake"], LICENSES, VERSIONS)
    six = build_subset(two_trees, parse_subset({**base, "target_size": 6}),
                       ["web", "lake"], LICENSES, VERSIONS)
    ids3 = set(three.selection.rows.column("id").to_pylist())
    ids6 = set(six.selection.rows.column("id").to_pylist())
    assert len(ids3) == 3 and len(ids6) == 6 and ids3 < ids6


def test_mds_uri_prints_a_subset_and_the_loader_mixes_it_with_sources(two_trees, data_root,
                                                                      capsys):
    from prx_assets import cli
    from prx_assets.loader import build_dataset, plan_leaves

    definition = parse_subset({"name": "tiny", "tiers": [1], "target_size": 4})
    built = build_subset(two_trees, definition, ["web", "lake"], LICENSES, VERSIONS)
    assert cli.main(["mds-uri", "--subset", "tiny"]) == 0
    assert capsys.readouterr().out.strip() == built.tree.path
    assert cli.main(["mds-uri"]) == 2 and cli.main(["mds-uri", "web", "--subset", "x"]) == 2

    weights = {"web": 1.0, "subset:tiny": 3.0}
    leaves = plan_leaves(data_root, 1, weights)
    share = sum(leaf.proportion for leaf in leaves if leaf.source == "subset:tiny")
    assert share == pytest.approx(0.75)
    dataset = build_dataset(data_root, 1, batch_size=1, weights=weights, shuffle=False)
    ids = {dataset[i]["id"] for i in range(dataset.num_samples)}
    subset_ids = set(built.selection.rows.column("id").to_pylist())
    assert subset_ids <= ids and any(i not in subset_ids for i in ids)


def test_a_null_attribute_meets_a_condition_only_when_it_lists_unknown():
    rows = pa.table({"visible_text": ["none", "dominant", None],
                     "subjects": [["animal"], [], None]})
    known = parse_subset({"name": "a", "attributes": {"visible_text": ["none", "some"]}})
    either = parse_subset({"name": "a", "attributes": {"visible_text": ["none", "unknown"],
                                                       "subjects": ["animal", "unknown"]}})
    assert condition_mask(rows, known.attributes[0]).to_pylist() == [True, False, False]
    assert [condition_mask(rows, c).to_pylist() for c in either.attributes] == \
        [[True, False, True], [True, False, True]]
    absent = parse_subset({"name": "a", "attributes": {"people": ["unknown"]}})
    assert condition_mask(rows, absent.attributes[0]).to_pylist() == [True] * 3
