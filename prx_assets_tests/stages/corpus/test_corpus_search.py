import io
from pathlib import Path

import lance
import pytest
from PIL import Image

from prx_assets.models.embeddings import MiniLMEmbedder
from prx_assets.stages.corpus.corpus import CORPUS_SCHEMA, build_corpus
from prx_assets.stages.corpus.search import (
    CorpusNotBuilt,
    EmptyCorpus,
    SearchError,
    UnknownId,
    attribute_filter,
    format_hits,
    search_text,
    similar,
)
from prx_assets.storage.refs import TableRef
from prx_assets.testing.corpus_tables import write_source
from prx_assets.testing.labelled_captions import TEST_CAPTIONS

HERON_TWIN = ("A heron wading through a shallow pond between tall reeds, its neck bent and "
              "its beak pointed at the water, under a cloudy sky.")


@pytest.fixture(scope="module")
def corpus(ray_session, tmp_path_factory):
    root = tmp_path_factory.mktemp("data") / "lance"
    embedder = MiniLMEmbedder(threads=1)
    web = write_source(root, "web", [
        ("heron", TEST_CAPTIONS["visual"][0], "visual"),
        ("bakery", TEST_CAPTIONS["visual"][1], "visual"),
        ("heron2", HERON_TWIN, "visual"),
        ("couple", TEST_CAPTIONS["nsfw"][0], "nsfw"),
    ], embedder, extra_kept=1)
    docs = write_source(root, "docs", [
        ("budget", TEST_CAPTIONS["text"][0], "text"),
        ("manual", TEST_CAPTIONS["text"][1], "text"),
    ], embedder)
    uri = TableRef.of(root / "corpus.lance")
    report = build_corpus(uri, [web, docs])
    return uri, report


def test_corpus_holds_one_row_per_labelled_kept_image_with_thumbnails(corpus):
    uri, report = corpus
    table = lance.dataset(str(uri))
    assert table.schema == CORPUS_SCHEMA
    assert report.rows_per_source == {"web": 4, "docs": 2}
    assert report.write.fragments == 1
    rows = {r["id"]: r for r in table.to_table().to_pylist()}
    assert "web:nocaption0" not in rows and "web:tiny" not in rows
    heron = rows["web:heron"]
    assert ((heron["tier"], heron["width"], heron["height"], heron["label"])
            == (512, 576, 448, "visual"))
    assert heron["caption"] == TEST_CAPTIONS["visual"][0] and heron["phash"] == 0
    assert max(Image.open(io.BytesIO(heron["thumbnail"])).size) == 256
    assert report.indexes["caption"] == "INVERTED" and report.indexes["label"] == "BITMAP"
    assert report.indexes["embedding"].startswith("none")  # too small to train IVF


def test_full_text_search_with_filters(corpus):
    uri, _ = corpus
    hits = search_text(uri, "spreadsheet budget", k=3)
    assert hits[0].id == "docs:budget" and hits[0].shape == "576x448"
    assert [h.id for h in search_text(uri, "heron reeds", k=5)][:2] in (
        ["web:heron", "web:heron2"], ["web:heron2", "web:heron"])
    assert search_text(uri, "heron", source="docs") == []
    assert {h.label for h in search_text(uri, "photograph", label="nsfw", k=5)} == {"nsfw"}
    line = format_hits(search_text(uri, "battery", k=1))
    assert line.startswith("docs:manual") and "text" in line and "576x448" in line
    with pytest.raises(SearchError, match="empty query"):
        search_text(uri, "  ")


def test_similar_returns_nearest_captions_without_the_query(corpus):
    uri, _ = corpus
    hits = similar(uri, "web:heron", k=3)
    assert hits[0].id == "web:heron2" and "web:heron" not in [h.id for h in hits]
    assert len(hits) == 3 and hits[0].score > hits[-1].score
    assert similar(uri, "docs:budget", k=1, label="text")[0].id == "docs:manual"
    with pytest.raises(UnknownId, match="web:nope"):
        similar(uri, "web:nope")


def test_missing_or_empty_corpus_errors(tmp_path):
    with pytest.raises(CorpusNotBuilt, match="materialise the `corpus` asset"):
        search_text(TableRef.of(tmp_path / "corpus.lance"), "x")
    empty = TableRef.of(tmp_path / "empty.lance")
    lance.write_dataset(CORPUS_SCHEMA.empty_table(), str(empty))
    with pytest.raises(EmptyCorpus):
        similar(empty, "a")


def test_cli_search_and_similar(corpus, monkeypatch, capsys):
    from prx_assets import cli

    uri, _ = corpus
    monkeypatch.setenv("PRX_DATA_ROOT", str(Path(uri.uri).parent.parent))
    assert cli.main(["search", "battery cover", "--k", "2", "--label", "text"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("docs:manual") and len(out) <= 2
    assert cli.main(["similar", "web:heron", "--k", "1"]) == 0
    assert capsys.readouterr().out.startswith("web:heron2")
    assert cli.main(["similar", "web:missing"]) == 2
    assert "no image with id 'web:missing'" in capsys.readouterr().err
    monkeypatch.setenv("PRX_DATA_ROOT", str(Path(uri.uri).parent / "elsewhere"))
    assert cli.main(["search", "heron"]) == 2
    assert "materialise the `corpus` asset" in capsys.readouterr().err


def test_cli_search_on_a_bucket_names_what_is_missing(s3_root, monkeypatch, capsys):
    """With PRX_DATA_ROOT in a bucket: no corpus table yet, and a bucket that does not
    exist, are both a clear error (exit 2), not "no table" read from a local Path test."""
    from prx_assets import cli

    assert cli.main(["search", "heron"]) == 2
    assert f"no corpus table at {s3_root}/lance/corpus.lance" in capsys.readouterr().err
    monkeypatch.setenv("PRX_DATA_ROOT", "s3://no-such-bucket-here/corpus")
    assert cli.main(["similar", "web:heron"]) == 2
    assert "bucket 'no-such-bucket-here' does not exist" in capsys.readouterr().err


def test_unknown_asks_for_the_records_that_do_not_know_an_attribute():
    assert attribute_filter("people=unknown") == "people IS NULL"
    assert attribute_filter("watermark=unknown") == "watermark IS NULL"
    assert attribute_filter("people=none") == "people IN ('none')"  # a null never matches
    with pytest.raises(SearchError, match="unknown alone"):
        attribute_filter("people=none,unknown")
