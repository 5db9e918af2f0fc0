"""attributes and subsets materialised in process over small tables written directly: the
caption-derived default, incremental reruns, typed columns, a subset's own tree and card."""

import json

import dagster as dg
import lance
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from prx_assets.defs.attributes import AttributerResource, attribute_checks, build_attributes
from prx_assets.defs.corpus import build_corpus_asset
from prx_assets.defs.resources import (
    CaptionerResource,
    ClassifierResource,
    RayResource,
    SourcesResource,
    StorageResource,
)
from prx_assets.models.embeddings import MiniLMEmbedder
from prx_assets.stages.corpus.search import SearchError, search_text
from prx_assets.storage.refs import TableRef
from prx_assets.testing.corpus_tables import (
    CAPTION_VERSION,
    CLASSIFIER_VERSION,
    write_source,
)
from prx_assets.testing.labelled_captions import labelled_test_captions
from prx_assets.testing.sources import write_sources


class FixedClassifier(ClassifierResource):
    """The classifier version the fixture's labels were written under."""

    def classifier_version(self) -> str:
        return CLASSIFIER_VERSION


def resources_for(tmp_path, **extra):
    (tmp_path / "imgs").mkdir(exist_ok=True)
    sources = write_sources(tmp_path / "s.yaml", [
        f"{{name: web, kind: image_folder, uri: {tmp_path / 'imgs'}, license: cc-by-4.0}}"])
    return {"captioner": CaptionerResource(active_version=CAPTION_VERSION),
            "classifier": ClassifierResource(), "ray_cluster": RayResource(),
            "sources": SourcesResource(path=str(sources)), "storage": StorageResource(),
            "attributer": AttributerResource(), **extra}


def test_attributes_are_tagged_once_per_version_as_typed_columns(ray_session, data_root,
                                                                 tmp_path):
    rows = labelled_test_captions()
    write_source(data_root / "lance", "web", [(i.split(":")[1], c, l) for i, c, l in rows],
                 MiniLMEmbedder())  # with caption labels: the corpus is built below
    partitions = dg.StaticPartitionsDefinition(["web"])
    resources = resources_for(tmp_path, classifier=ClassifierResource(
        backend="embedded"))
    instance = dg.DagsterInstance.ephemeral()
    assets = [build_attributes(partitions), *attribute_checks(partitions)]

    first = dg.materialize(assets, partition_key="web", resources=resources, instance=instance)
    assert first.success
    meta = first.get_asset_materialization_events()[0].materialization.metadata
    assert (meta["rows_processed"].value, meta["rows_reused"].value) == (6, 0)
    assert meta["origin"].value == "caption_derived" and meta["valid_share"].value == 1.0
    assert meta["attribute_version"].value == AttributerResource().attribute_version()
    captions_read = lance.dataset(str(data_root / "lance/captions/web.lance")).version
    assert meta["input_version/captions"].value == captions_read
    assert all(e.passed for e in first.get_asset_check_evaluations())

    table = lance.dataset(str(data_root / "lance/attributes/web.lance"))
    assert str(table.schema.field("subjects").type) == "list<item: string>"
    documents = table.to_table(filter="medium = 'document'").column("id").to_pylist()
    assert documents == ["web:text1"]  # the photographed manual page
    photos = table.to_table(filter="medium = 'photo'").column("id").to_pylist()
    assert {"web:visual0", "web:visual1"} <= set(photos)
    assert table.to_table(columns=["aesthetic_quality"]).column(0).null_count == 6

    again = dg.materialize(assets, partition_key="web", resources=resources, instance=instance)
    meta = again.get_asset_materialization_events()[0].materialization.metadata
    assert (meta["rows_processed"].value, meta["rows_reused"].value) == (0, 6)
    assert lance.dataset(str(data_root / "lance/attributes/web.lance")).count_rows() == 6
    assert pc.all(pc.equal(table.to_table(columns=["status"]).column(0), "ok")).as_py()
    json.dumps(meta["reasons"].value)

    # The corpus carries the active records' typed columns; search filters on them.
    resources["classifier"] = FixedClassifier()
    built = dg.materialize([build_corpus_asset(partitions)], resources=resources,
                           instance=instance)
    assert built.success
    corpus = TableRef.of(data_root / "lance/corpus.lance")
    assert corpus.open().schema.field("medium").type == pa.string()
    corpus_meta = built.get_asset_materialization_events()[0].materialization.metadata
    assert corpus_meta["input_version/attributes/web"].value == table.version
    hits = search_text(corpus, "battery", k=5, where=["medium=document"])
    assert [h.id for h in hits] == ["web:text1"]
    assert search_text(corpus, "battery", k=5, where=["medium=photo"]) == []
    # The caption backend withholds `subjects` (no hand labels measure it): unknown, not "no".
    assert search_text(corpus, "battery", k=5, where=["subjects=text"]) == []
    assert [h.id for h in search_text(corpus, "battery", k=5, where=[
        "subjects=unknown", "watermark=false"])] == ["web:text1"]
    withheld = table.to_table(columns=["withheld"]).column(0).unique().to_pylist()
    assert len(withheld) == 1 and "subjects: no hand labels" in withheld[0]
    with pytest.raises(SearchError, match="hologram"):
        search_text(corpus, "battery", where=["medium=hologram"])
    with pytest.raises(SearchError, match=r"1\.\.5"):
        search_text(corpus, "battery", where=["aesthetic_quality>=9"])


def test_subsets_asset_builds_one_partition_per_subset_with_lineage(data_root, tmp_path):
    import numpy as np

    from prx_assets.defs.subsets import subset_defs
    from prx_assets.stages.attributes.schema import Tagged, attribute_rows
    from prx_assets.stages.labels.labels import label_rows
    from prx_assets.stages.shards import mds, plan
    from prx_assets.storage.lance_tables import overwrite_rows
    from prx_assets.storage.layout import Storage
    from prx_assets.storage.tables import ATTRIBUTES, CAPTION_LABELS, MDS_SAMPLES
    from prx_assets.testing.mds_corpus import ACTIVE, build_corpus, inputs_for

    build_corpus(data_root, "web", per_shape=4)
    mds.write_mds_tree(inputs_for(data_root, "web"), data_root, "web",
                       plan.WriteOptions(parallel=False))
    storage = Storage(str(data_root))
    ids = sorted(storage.table(MDS_SAMPLES, "web").to_table(columns=["id"])["id"].to_pylist())
    resources = resources_for(tmp_path, captioner=CaptionerResource(active_version=ACTIVE))
    n = len(ids)
    labels = label_rows(ids, [ACTIVE] * n, ClassifierResource().classifier_version(),
                        ["visual"] * n, np.zeros((n, 3), np.float32),
                        np.zeros((n, 384), np.float32))
    overwrite_rows(storage.table(CAPTION_LABELS, "web"), labels, labels.schema)
    records = attribute_rows([Tagged(i, ACTIVE, {"medium": "photo" if k % 2 else "painting"},
                                     "ok", "caption_derived") for k, i in enumerate(ids)],
                             AttributerResource().attribute_version())
    overwrite_rows(storage.table(ATTRIBUTES, "web"), records, records.schema)
    subsets_file = tmp_path / "subsets.yaml"
    subsets_file.write_text("subsets:\n  - {name: photos, attributes: {medium: [photo]}}\n"
                            "  - {name: everything}\n")

    (asset,) = subset_defs(subsets_file).assets
    assert sorted(asset.partitions_def.get_partition_keys()) == ["everything", "photos"]
    result = dg.materialize([asset], partition_key="photos", resources=resources)
    assert result.success
    meta = result.get_asset_materialization_events()[0].materialization.metadata
    assert meta["samples"].value == n // 2
    assert meta["definition_version"].value.startswith("1-")
    assert meta["input_version/mds_samples/web"].value == \
        storage.table(MDS_SAMPLES, "web").latest_version()
    assert meta["input_version/attributes/web"].value == \
        storage.table(ATTRIBUTES, "web").latest_version()
    assert (data_root / "mds" / "subsets" / "photos" / "card.md").exists()
