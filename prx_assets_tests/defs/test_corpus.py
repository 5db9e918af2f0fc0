"""The corpus asset across runs: a full build first, then only the sources whose inputs
changed are replaced (their rows deleted, the new ones appended) and the indexes updated;
an unchanged rerun keeps the data version; the result equals a full rebuild's rows."""

import dagster as dg
import lance
import pyarrow as pa

from prx_assets.defs.corpus import build_corpus_asset, source_tables
from prx_assets.defs.resources import (
    CaptionerResource,
    ClassifierResource,
    RayResource,
    SourcesResource,
    StorageResource,
)
from prx_assets.models.embeddings import MiniLMEmbedder
from prx_assets.stages.corpus.corpus import build_corpus
from prx_assets.stages.corpus.search import search_text
from prx_assets.storage.layout import Storage
from prx_assets.storage.refs import TableRef
from prx_assets.testing.corpus_tables import CAPTION_VERSION, write_source
from prx_assets.testing.labelled_captions import TEST_CAPTIONS
from prx_assets.testing.sources import write_sources

WEB = [("heron", TEST_CAPTIONS["visual"][0], "visual"),
       ("bakery", TEST_CAPTIONS["visual"][1], "visual"),
       ("couple", TEST_CAPTIONS["nsfw"][0], "nsfw")]
DOCS = [("budget", TEST_CAPTIONS["text"][0], "text")]
DOCS_AGAIN = [("budget", TEST_CAPTIONS["text"][0], "text"),
              ("manual", TEST_CAPTIONS["text"][1], "text")]


def _source(root, name, rows, embedder):
    """The source's tables, its labels under the classifier version the asset asks for."""
    tables = write_source(root, name, rows, embedder)
    labels = lance.dataset(str(tables.labels)).to_table()
    version = ClassifierResource().classifier_version()
    labels = labels.set_column(labels.schema.get_field_index("classifier_version"),
                               "classifier_version", pa.array([version] * labels.num_rows))
    lance.write_dataset(labels, str(tables.labels), mode="overwrite")
    return tables


def _meta(result) -> dg.AssetMaterialization:
    return result.get_asset_materialization_events()[0].materialization


def _rows(uri) -> dict:
    rows = lance.dataset(str(uri)).to_table().to_pylist()
    assert len({r["id"] for r in rows}) == len(rows), "duplicate ids"
    return {r["id"]: r for r in rows}


def test_corpus_replaces_only_changed_sources(ray_session, data_root, tmp_path):
    root, embedder = data_root / "lance", MiniLMEmbedder(threads=1)
    _source(root, "web", WEB, embedder)
    _source(root, "docs", DOCS, embedder)
    entries = {name: f"{{name: {name}, kind: image_folder, uri: {tmp_path / name}}}"
               for name in ("web", "docs")}
    sources = write_sources(tmp_path / "s.yaml", list(entries.values()))
    resources = {"captioner": CaptionerResource(active_version=CAPTION_VERSION),
                 "classifier": ClassifierResource(), "ray_cluster": RayResource(),
                 "sources": SourcesResource(path=str(sources)), "storage": StorageResource()}
    asset = build_corpus_asset(dg.StaticPartitionsDefinition(["web", "docs"]))
    instance = dg.DagsterInstance.ephemeral()

    def run() -> dg.AssetMaterialization:
        result = dg.materialize([asset], resources=resources, instance=instance)
        assert result.success
        return _meta(result)

    def counts(m) -> tuple:
        return tuple(m.metadata[k].value for k in ("rows_processed", "rows_reused",
                                                   "rows_removed"))

    first = run()
    assert counts(first) == (4, 0, 0) and first.metadata["full_rebuild"].value == "no corpus yet"

    again = run()  # nothing changed: nothing rewritten, same data version
    assert counts(again) == (0, 4, 0)
    assert again.metadata["lance_version"].value == first.metadata["lance_version"].value
    assert again.tags["dagster/data_version"] == first.tags["dagster/data_version"]

    # docs gains a row (new table versions): only docs is looked at, only its new row
    # written (budget's row is unchanged), the indexes updated.
    _source(root, "docs", DOCS_AGAIN, embedder)
    web_before = {i: r for i, r in _rows(root / "corpus.lance").items() if r["source"] == "web"}
    updated = run()
    assert counts(updated) == (1, 4, 0)
    assert updated.metadata["sources_replaced"].value == "docs"
    assert updated.metadata["full_rebuild"].value == "no"
    assert updated.tags["dagster/data_version"] != first.tags["dagster/data_version"]
    assert "(updated)" in updated.metadata["indexes"].value
    rows = _rows(root / "corpus.lance")
    assert {i: r for i, r in rows.items() if r["source"] == "web"} == web_before
    assert search_text(TableRef.of(root / "corpus.lance"), "battery", k=1)[0].id == "docs:manual"
    # The same rows as a full build from the same inputs.
    store, version = Storage(str(data_root)), ClassifierResource().classifier_version()
    full = TableRef.of(tmp_path / "full.lance")
    build_corpus(full, [source_tables(store, name, CAPTION_VERSION, version)
                        for name in ("web", "docs")])
    assert _rows(full) == rows

    # web leaves the sources: its rows leave the corpus.
    write_sources(sources, [entries["docs"]])
    removed = run()
    assert counts(removed) == (0, 2, 3)
    assert {r["source"] for r in _rows(root / "corpus.lance").values()} == {"docs"}


def test_a_new_classifier_version_updates_every_source_and_keeps_thumbnails(
        ray_session, data_root, tmp_path):
    """A new classifier version may change any row: every source is updated (not
    rebuilt), only rows that differ are written, thumbnails are carried, indexes retrained."""
    root, embedder = data_root / "lance", MiniLMEmbedder(threads=1)
    sources_tables = [_source(root, "web", WEB, embedder), _source(root, "docs", DOCS, embedder)]
    entries = [f"{{name: {name}, kind: image_folder, uri: {tmp_path / name}}}"
               for name in ("web", "docs")]
    sources = write_sources(tmp_path / "s.yaml", entries)
    asset = build_corpus_asset(dg.StaticPartitionsDefinition(["web", "docs"]))
    instance = dg.DagsterInstance.ephemeral()

    def run(classifier: ClassifierResource) -> dg.AssetMaterialization:
        resources = {"captioner": CaptionerResource(active_version=CAPTION_VERSION),
                     "classifier": classifier, "ray_cluster": RayResource(),
                     "sources": SourcesResource(path=str(sources)),
                     "storage": StorageResource()}
        result = dg.materialize([asset], resources=resources, instance=instance)
        assert result.success
        return _meta(result)

    run(ClassifierResource())
    thumbnails = {i: r["thumbnail"] for i, r in _rows(root / "corpus.lance").items()}
    new = ClassifierResource(l2=0.5)
    assert new.classifier_version() != ClassifierResource().classifier_version()
    for tables in sources_tables:
        labels = lance.dataset(str(tables.labels)).to_table().to_pylist()
        for row in labels:
            row["classifier_version"] = new.classifier_version()
            row["label"] = "text" if row["id"] == "web:heron" else row["label"]
        schema = lance.dataset(str(tables.labels)).schema
        lance.write_dataset(pa.Table.from_pylist(labels, schema=schema), str(tables.labels),
                            mode="overwrite")
        # Stored bytes broken, raw sha256 kept: a thumbnail made again would fail.
        bucketed = lance.dataset(str(tables.bucketed)).to_table()
        broken = pa.array([b"broken" if b else b for b in bucketed.column("image").to_pylist()],
                          bucketed.schema.field("image").type)
        lance.write_dataset(bucketed.set_column(bucketed.schema.get_field_index("image"),
                                                "image", broken),
                            str(tables.bucketed), mode="overwrite")

    updated = run(new)
    assert updated.metadata["full_rebuild"].value == "no"
    assert updated.metadata["sources_replaced"].value == "web, docs"
    assert updated.metadata["rows_processed"].value == 1  # heron's label alone changed
    assert "(updated)" not in updated.metadata["indexes"].value  # retrained
    rows = _rows(root / "corpus.lance")
    assert rows["web:heron"]["label"] == "text"
    assert {i: r["thumbnail"] for i, r in rows.items()} == thumbnails
