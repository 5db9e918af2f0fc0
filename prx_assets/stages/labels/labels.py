"""Caption labels: would a person look at this image or read it, and is it sexually explicit?

Labels `visual`, `text`, `nsfw`, decided from the caption alone. The embedded backend (the
default, CPU, nothing to download) embeds each caption with MiniLM and applies a small
multinomial logistic regression trained on the labelled caption set kept in
`stages/labels/data/caption_labels.jsonl`; its weights are stored in
`stages/labels/data/caption_classifier.npz` and rebuilt deterministically by
`train_classifier` (see scripts/train_caption_classifier.py). The embedding is kept: it is
the corpus table's vector column.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa

from prx_assets.models.embeddings import (
    EMBEDDING_DIM,
    MODEL_ID,
    MiniLMEmbedder,
    model_fingerprint,
    shared_embedder,
)
from prx_assets.storage.filters import all_of, eq_filter

LABELS = ("visual", "text", "nsfw")
DATA_DIR = Path(__file__).resolve().parent / "data"
CAPTION_SET = DATA_DIR / "caption_labels.jsonl"
WEIGHTS = DATA_DIR / "caption_classifier.npz"
# Captions written apart from the caption set and never trained or calibrated on: the
# held-out measure of precision and recall per label (docs/labels_and_search.md).
HELD_OUT = DATA_DIR / "held_out_captions.jsonl"
DEFAULT_L2 = 1e-3
# A caption is labelled nsfw only when that score reaches this; below it the better of the
# other two labels wins. A false nsfw drops a good image from training, so the label must
# be confident (calibrated on the validation split by `calibrate_nsfw_min_score`).
DEFAULT_NSFW_MIN_SCORE = 0.5

LABELS_SCHEMA = pa.schema([
    pa.field("id", pa.string(), nullable=False),
    pa.field("caption_version", pa.string(), nullable=False),
    pa.field("classifier_version", pa.string(), nullable=False),
    pa.field("label", pa.string(), nullable=False),
    pa.field("score_visual", pa.float32()),
    pa.field("score_text", pa.float32()),
    pa.field("score_nsfw", pa.float32()),
    pa.field("embedding", pa.list_(pa.float32(), EMBEDDING_DIM)),
    pa.field("created_at", pa.timestamp("us", tz="UTC")),
])


def active_labels_filter(caption_version: str, classifier_version: str) -> str:
    """Lance SQL filter selecting the rows downstream assets read."""
    condition = all_of(eq_filter("caption_version", caption_version),
                       eq_filter("classifier_version", classifier_version))
    assert condition is not None  # two conditions, neither empty
    return condition


@dataclass(frozen=True)
class LabelledCaption:
    caption: str
    label: str
    split: str  # "train" or "validation"
    origin: str  # "phrase_bank" or "hand"


def load_caption_set(path: Path = CAPTION_SET) -> list[LabelledCaption]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    captions = [LabelledCaption(r["caption"], r["label"], r["split"], r.get("origin", ""))
                for r in rows]
    unknown = {c.label for c in captions} - set(LABELS)
    if unknown:
        raise ValueError(f"{path}: unknown labels {sorted(unknown)}; expected {LABELS}")
    return captions


def file_sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def version_hash(**parts: object) -> str:
    """A short, stable hash of what determines a result (sorted JSON of the parts)."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


@dataclass
class LinearClassifier:
    """Softmax over `embedding @ weights + bias`; columns follow LABELS."""

    weights: np.ndarray  # (EMBEDDING_DIM, len(LABELS))
    bias: np.ndarray  # (len(LABELS),)
    l2: float = DEFAULT_L2
    training_set_sha: str = ""
    validation: dict = field(default_factory=dict)  # per-class accuracy, counts
    nsfw_min_score: float = 0.0  # 0: plain argmax

    def scores(self, embeddings: np.ndarray) -> np.ndarray:
        return softmax(embeddings @ self.weights + self.bias)

    def decide(self, scores: np.ndarray) -> list[str]:
        """One label per row of scores: the argmax, except that nsfw needs nsfw_min_score."""
        nsfw = LABELS.index("nsfw")
        others = scores.copy()
        others[:, nsfw] = -1.0
        best = scores.argmax(1)
        unsure = (best == nsfw) & (scores[:, nsfw] < self.nsfw_min_score)
        best[unsure] = others[unsure].argmax(1)
        return [LABELS[i] for i in best]

    def predict(self, embeddings: np.ndarray) -> list[str]:
        return self.decide(self.scores(embeddings))

    def save(self, path: Path = WEIGHTS) -> None:
        meta = {"l2": self.l2, "training_set_sha": self.training_set_sha,
                "validation": self.validation, "model": MODEL_ID,
                "nsfw_min_score": self.nsfw_min_score}
        np.savez(path, weights=self.weights.astype(np.float32), bias=self.bias.astype(np.float32),
                 meta=np.array(json.dumps(meta)))

    @classmethod
    def load(cls, path: Path = WEIGHTS) -> LinearClassifier:
        with np.load(path) as stored:
            meta = json.loads(str(stored["meta"]))
            return cls(stored["weights"], stored["bias"], meta["l2"], meta["training_set_sha"],
                       meta["validation"], meta.get("nsfw_min_score", 0.0))


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max(1, keepdims=True))
    return shifted / shifted.sum(1, keepdims=True)


def train_classifier(embeddings: np.ndarray, labels: Sequence[str],
                     l2: float = DEFAULT_L2) -> LinearClassifier:
    """Multinomial logistic regression by L-BFGS from zeros: deterministic for a given input."""
    # Imported here: the labelling actors import this module but never train (0.24 s each).
    import scipy.optimize

    y = np.array([LABELS.index(label) for label in labels])
    onehot = np.eye(len(LABELS))[y]
    n, d = embeddings.shape
    x = embeddings.astype(np.float64)

    def loss_and_grad(theta: np.ndarray) -> tuple[float, np.ndarray]:
        w, b = theta[:d * len(LABELS)].reshape(d, len(LABELS)), theta[d * len(LABELS):]
        p = softmax(x @ w + b)
        loss = -np.log(p[np.arange(n), y] + 1e-12).mean() + l2 * (w ** 2).sum()
        residual = (p - onehot) / n
        grad = np.concatenate([(x.T @ residual + 2 * l2 * w).ravel(), residual.sum(0)])
        return loss, grad

    theta0 = np.zeros(d * len(LABELS) + len(LABELS))
    result = scipy.optimize.minimize(loss_and_grad, theta0, jac=True, method="L-BFGS-B",
                                     options={"maxiter": 500})
    w = result.x[:d * len(LABELS)].reshape(d, len(LABELS))
    return LinearClassifier(w.astype(np.float32), result.x[d * len(LABELS):].astype(np.float32), l2)


def per_class_accuracy(predicted: Sequence[str], truth: Sequence[str]) -> dict[str, dict]:
    report = {}
    for label in LABELS:
        idx = [i for i, t in enumerate(truth) if t == label]
        correct = sum(predicted[i] == label for i in idx)
        report[label] = {"n": len(idx), "accuracy": round(correct / len(idx), 4) if idx else None}
    return report


def precision_recall(predicted: Sequence[str], truth: Sequence[str]) -> dict[str, dict]:
    """Per label: how many captions truly have it (n), and precision and recall of the
    predictions (None where undefined: nothing predicted, or nothing to find)."""
    report = {}
    for label in LABELS:
        tp = sum(p == label and t == label for p, t in zip(predicted, truth, strict=True))
        predicted_n = sum(p == label for p in predicted)
        n = sum(t == label for t in truth)
        report[label] = {"n": n, "predicted": predicted_n,
                         "precision": round(tp / predicted_n, 4) if predicted_n else None,
                         "recall": round(tp / n, 4) if n else None}
    return report


def load_held_out(path: Path = HELD_OUT) -> tuple[list[str], list[str]]:
    """Captions and their true labels, from the held-out file."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["caption"] for r in rows], [r["label"] for r in rows]


def held_out_report(classifier: LinearClassifier, embedder: MiniLMEmbedder,
                    path: Path = HELD_OUT) -> dict[str, dict]:
    captions, truth = load_held_out(path)
    return precision_recall(classifier.predict(embedder.embed(captions)), truth)


def calibrate_nsfw_min_score(scores: np.ndarray, truth: Sequence[str],
                             floor: float = DEFAULT_NSFW_MIN_SCORE) -> float:
    """The nsfw threshold: at least `floor`, raised just above the highest nsfw score of a
    validation caption that is not nsfw, unless that would lose a true nsfw caption."""
    nsfw = LABELS.index("nsfw")
    is_nsfw = np.array([t == "nsfw" for t in truth])
    false_top = float(scores[~is_nsfw, nsfw].max()) if (~is_nsfw).any() else 0.0
    true_low = float(scores[is_nsfw, nsfw].min()) if is_nsfw.any() else 1.0
    candidate = min(false_top + 1e-3, true_low)
    return round(max(floor, candidate), 4)


def fit_on_caption_set(embedder: MiniLMEmbedder, path: Path = CAPTION_SET,
                       l2: float = DEFAULT_L2) -> LinearClassifier:
    """Train on the `train` split, calibrate the nsfw threshold and measure on `validation`
    (all, and hand-written only)."""
    captions = load_caption_set(path)
    vectors = embedder.embed([c.caption for c in captions])
    train = [i for i, c in enumerate(captions) if c.split == "train"]
    classifier = train_classifier(vectors[train], [captions[i].label for i in train], l2)
    classifier.training_set_sha = file_sha(path)
    validation = [i for i, c in enumerate(captions) if c.split == "validation"]
    classifier.nsfw_min_score = calibrate_nsfw_min_score(
        classifier.scores(vectors[validation]), [captions[i].label for i in validation])
    hand = [i for i in validation if captions[i].origin == "hand"]
    classifier.validation = {
        "all": per_class_accuracy(classifier.predict(vectors[validation]),
                                  [captions[i].label for i in validation]),
        "hand_written": per_class_accuracy(classifier.predict(vectors[hand]),
                                           [captions[i].label for i in hand]),
    }
    return classifier


def load_embedded_classifier(path: Path = WEIGHTS, caption_set: Path = CAPTION_SET
                             ) -> LinearClassifier:
    """The stored classifier; refuses weights trained on another version of the caption set."""
    classifier = LinearClassifier.load(path)
    current = file_sha(caption_set)
    if classifier.training_set_sha != current:
        raise RuntimeError(
            f"{path} was trained on caption set {classifier.training_set_sha}, but "
            f"{caption_set} is now {current}: run scripts/train_caption_classifier.py")
    return classifier


def embedded_classifier_version(l2: float = DEFAULT_L2) -> str:
    # The stored weights (and their nsfw threshold) are part of what decides a label.
    return version_hash(backend="embedded", model=MODEL_ID, weights=model_fingerprint(),
                        training_set=file_sha(CAPTION_SET), classifier="softmax_regression",
                        l2=l2, stored=file_sha(WEIGHTS))


# --- labelling batches -------------------------------------------------------------------

def label_rows(ids: Sequence[str], caption_version: Sequence[str], classifier_version: str,
               labels: Sequence[str], scores: np.ndarray, embeddings: np.ndarray) -> pa.Table:
    """Rows of LABELS_SCHEMA; `scores` has one column per entry of LABELS."""
    now = datetime.now(UTC)
    n = len(ids)
    columns = {
        "id": pa.array(ids, pa.string()),
        "caption_version": pa.array(caption_version, pa.string()),
        "classifier_version": pa.array([classifier_version] * n, pa.string()),
        "label": pa.array(labels, pa.string()),
        **{f"score_{name}": pa.array(scores[:, i].astype(np.float32), pa.float32())
           for i, name in enumerate(LABELS)},
        "embedding": pa.FixedSizeListArray.from_arrays(
            pa.array(embeddings.astype(np.float32).ravel(), pa.float32()), EMBEDDING_DIM),
        "created_at": pa.array([now] * n, pa.timestamp("us", tz="UTC")),
    }
    return pa.Table.from_pydict(columns, schema=LABELS_SCHEMA)


class EmbeddedLabeler:
    """Ray Data callable class: one MiniLM + classifier per actor, caption batches in."""

    def __init__(self, classifier_version: str, threads: int = 1):
        self.classifier_version = classifier_version
        self.embedder = shared_embedder(threads)
        self.classifier = load_embedded_classifier()

    def __call__(self, batch: pa.Table) -> pa.Table:
        captions = batch.column("caption").to_pylist()
        embeddings = self.embedder.embed([c or "" for c in captions])
        scores = self.classifier.scores(embeddings)
        labels = self.classifier.decide(scores)
        return label_rows(batch.column("id").to_pylist(),
                          batch.column("caption_version").to_pylist(),
                          self.classifier_version, labels, scores, embeddings)
