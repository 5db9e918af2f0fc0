import numpy as np
import pytest

from prx_assets.models.embeddings import EMBEDDING_DIM, MiniLMEmbedder
from prx_assets.stages.labels.labels import (
    CAPTION_SET,
    LABELS,
    LabelledCaption,
    embedded_classifier_version,
    file_sha,
    load_caption_set,
    load_embedded_classifier,
    per_class_accuracy,
    train_classifier,
)
from prx_assets_tests.fixtures.labelled_captions import TEST_CAPTIONS


@pytest.fixture(scope="module")
def embedder() -> MiniLMEmbedder:
    return MiniLMEmbedder(threads=1)


def test_embeddings_are_normalised_and_put_similar_captions_close(embedder):
    texts = [TEST_CAPTIONS["visual"][0], TEST_CAPTIONS["visual"][1], TEST_CAPTIONS["text"][0]]
    vectors = embedder.embed([*texts, "", "a short one"])
    assert vectors.shape == (5, EMBEDDING_DIM) and vectors.dtype == np.float32
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    # order-independent: batching sorts by length internally
    assert np.allclose(embedder.embed(texts[::-1])[::-1], vectors[:3], atol=1e-5)
    spreadsheet = embedder.embed(["A screenshot of a spreadsheet with a budget table"])[0]
    assert vectors[2] @ spreadsheet > vectors[0] @ spreadsheet


def test_stored_classifier_labels_unseen_captions(embedder):
    classifier = load_embedded_classifier()
    captions = [(c, label) for label, cs in TEST_CAPTIONS.items() for c in cs]
    scores = classifier.scores(embedder.embed([c for c, _ in captions]))
    assert np.allclose(scores.sum(1), 1.0, atol=1e-5)
    assert classifier.predict(embedder.embed([c for c, _ in captions])) == [l for _, l in captions]
    # the stored validation report covers every class and is worth shipping
    for label in LABELS:
        assert classifier.validation["all"][label]["n"] >= 30
        assert classifier.validation["all"][label]["accuracy"] >= 0.9


def test_caption_set_is_fixed_split_balanced_and_matches_the_weights():
    captions = load_caption_set()
    assert load_embedded_classifier().training_set_sha == file_sha(CAPTION_SET)
    for label in LABELS:
        of_label = [c for c in captions if c.label == label]
        assert len(of_label) >= 100
        assert {c.split for c in of_label} == {"train", "validation"}
        assert any(c.origin == "hand" and c.split == "validation" for c in of_label)
    assert len({c.caption for c in captions}) == len(captions)


def test_training_is_deterministic_and_learns_separable_classes():
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(3, 16))
    x = np.concatenate([centres[i] + 0.3 * rng.normal(size=(40, 16)) for i in range(3)])
    y = [LABELS[i] for i in range(3) for _ in range(40)]
    first, second = train_classifier(x, y), train_classifier(x, y)
    assert np.array_equal(first.weights, second.weights)
    report = per_class_accuracy(first.predict(x), y)
    assert all(report[label]["accuracy"] == 1.0 for label in LABELS)


def test_classifier_version_changes_with_its_parameters():
    assert embedded_classifier_version() == embedded_classifier_version()
    assert embedded_classifier_version(l2=0.1) != embedded_classifier_version()


def test_unknown_labels_in_the_caption_set_are_refused(tmp_path):
    bad = tmp_path / "set.jsonl"
    bad.write_text('{"caption": "x", "label": "maybe", "split": "train"}\n')
    with pytest.raises(ValueError, match="maybe"):
        load_caption_set(bad)
    assert LabelledCaption("x", "text", "train", "").label == "text"
