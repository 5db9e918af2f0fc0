import numpy as np
import pytest
import torch

from prx_assets.models.embeddings import BATCH_SIZE, EMBEDDING_DIM, MiniLMEmbedder


def test_captions_embed_to_unit_vectors_whatever_their_order_in_the_batch():
    embedder = MiniLMEmbedder(threads=1)
    texts = ["A red barn in a field.", "", "A page of printed text with a chart."]
    vectors = embedder.embed(texts)
    assert vectors.shape == (3, EMBEDDING_DIM) and vectors.dtype == np.float32
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert np.allclose(embedder.embed(texts[::-1])[::-1], vectors, atol=1e-5)
    assert embedder.device == "cpu" and embedder.batch_size == BATCH_SIZE


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_a_gpu_embedder_without_a_gpu_is_a_clear_error_not_a_silent_cpu_run():
    with pytest.raises(RuntimeError, match="no CUDA device"):
        MiniLMEmbedder(device="cuda")
    with pytest.raises(ValueError, match="unknown embedding device"):
        MiniLMEmbedder(device="tpu")
