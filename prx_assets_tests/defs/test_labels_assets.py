import dagster as dg
import lance

from prx_assets.defs.corpus import build_corpus_asset
from prx_assets.defs.labels import build_caption_labels, caption_labels_checks
from prx_assets.defs.resources import (
    CaptionerResource,
    ClassifierResource,
    RayResource,
    SourcesResource,
    StorageResource,
)
from prx_assets.demo.runner import check_results
from prx_assets.stages.corpus.search import search_text
from prx_assets.storage.refs import TableRef
from prx_assets.testing.corpus_tables import CAPTION_VERSION, write_source
from prx_assets.testing.labelled_captions import labelled_test_captions
from prx_assets.testing.sources import write_sources


def test_caption_labels_then_corpus(ray_session, data_root, tmp_path):
    rows = labelled_test_captions()
    write_source(data_root / "lance", "web", [(i.split(":")[1], c, l) for i, c, l in rows], None)
    (tmp_path / "imgs").mkdir()
    sources = write_sources(tmp_path / "s.yaml",
                            [f"{{name: web, kind: image_folder, uri: {tmp_path / 'imgs'}}}"])
    partitions = dg.StaticPartitionsDefinition(["web"])
    resources = {"captioner": CaptionerResource(active_version=CAPTION_VERSION),
                 "classifier": ClassifierResource(), "ray_cluster": RayResource(),
                 "sources": SourcesResource(path=str(sources)),
                 "storage": StorageResource()}
    instance = dg.DagsterInstance.ephemeral()

    labelled = dg.materialize(
        [build_caption_labels(partitions), *caption_labels_checks(partitions)],
        partition_key="web", resources=resources, instance=instance)
    assert labelled.success
    meta = labelled.get_asset_materialization_events()[0].materialization.metadata
    assert meta["labelled_now"].value == 6 and meta["coverage"].value == 1.0
    assert (meta["rows_processed"].value, meta["rows_reused"].value,
            meta["rows_removed"].value) == (6, 0, 0)
    # The embedded classifier runs on the CPU: 6 captions priced per CPU machine-hour.
    assert "per 1,000 images on 1 CPU machine" in meta["cost_per_1000_images"].value
    assert meta["stage_seconds_in_words"].value.endswith(("s", "min"))
    shares = {r.data["label"]: r.data["count"] for r in meta["label_shares"].value.records}
    assert shares == {"visual": 2, "text": 2, "nsfw": 2}
    accuracy = {r.data["label"]: r.data["accuracy"]
                for r in meta["classifier_validation"].value.records}
    assert set(accuracy) == {"visual", "text", "nsfw"}
    assert meta["classifier_version"].value == ClassifierResource().classifier_version()
    # Lineage: the captions version labelled is the one recorded (not the instance's view).
    captions_read = lance.dataset(str(data_root / "lance/captions/web.lance")).version
    assert meta["input_version/captions"].value == captions_read
    checks = {e.check_name: e for e in labelled.get_asset_check_evaluations()}
    assert checks["label_coverage"].passed
    shares_check = checks["label_shares"]
    assert not shares_check.passed and shares_check.severity == dg.AssetCheckSeverity.WARN
    assert "text" in shares_check.metadata["outside_bounds"].value
    # The warning says what it measured against which bound (the demo summary prints it).
    assert shares_check.description == ("visual 33.3% < bound 80%; text 33.3% > bound 10%; "
                                        "nsfw 33.3% > bound 2% of the labelled captions")
    outcomes, notes = check_results(labelled)
    assert outcomes["caption_labels:label_shares"] == "failed (WARN)"
    assert notes == {"caption_labels:label_shares": shares_check.description}

    built = dg.materialize([build_corpus_asset(partitions)], resources=resources,
                           instance=instance)
    assert built.success
    corpus = lance.dataset(str(data_root / "lance/corpus.lance"))
    assert corpus.count_rows() == 6
    hits = search_text(TableRef.of(data_root / "lance/corpus.lance"), "battery", k=1)
    assert hits[0].id == "web:text1"
    corpus_meta = built.get_asset_materialization_events()[0].materialization.metadata
    assert corpus_meta["dagster/row_count"].value == 6
    assert "INVERTED" in corpus_meta["indexes"].value
    labels_read = lance.dataset(str(data_root / "lance/caption_labels/web.lance")).version
    assert corpus_meta["input_version/caption_labels/web"].value == labels_read
    assert corpus_meta["input_version/captions/web"].value == captions_read
