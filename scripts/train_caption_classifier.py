"""Retrains the embedded caption classifier from prx_assets/stages/labels/data/caption_labels.jsonl
and stores its weights (and validation accuracy per class) beside it.

    python scripts/train_caption_classifier.py
"""

from __future__ import annotations

import json

from prx_assets.models.embeddings import MiniLMEmbedder
from prx_assets.stages.labels.labels import WEIGHTS, fit_on_caption_set


def main() -> None:
    classifier = fit_on_caption_set(MiniLMEmbedder())
    classifier.save(WEIGHTS)
    print(f"wrote {WEIGHTS}")
    print(json.dumps(classifier.validation, indent=2))


if __name__ == "__main__":
    main()
