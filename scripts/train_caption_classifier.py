"""Retrains the embedded caption classifier from prx_assets/stages/labels/data/caption_labels.jsonl
and stores its weights (validation accuracy per class and the calibrated nsfw threshold)
beside it; then prints precision and recall per label on the held-out captions
(held_out_captions.jsonl, never trained or calibrated on).

    python scripts/train_caption_classifier.py
"""

from __future__ import annotations

import json

from prx_assets.models.embeddings import MiniLMEmbedder
from prx_assets.stages.labels.labels import WEIGHTS, fit_on_caption_set, held_out_report


def main() -> None:
    embedder = MiniLMEmbedder()
    classifier = fit_on_caption_set(embedder)
    classifier.save(WEIGHTS)
    print(f"wrote {WEIGHTS} (nsfw_min_score {classifier.nsfw_min_score})")
    print(json.dumps(classifier.validation, indent=2))
    print("held out:", json.dumps(held_out_report(classifier, embedder), indent=2))


if __name__ == "__main__":
    main()
