"""bench.semantic at toy sizes: every figure is produced and the planted answers come back."""

from bench.semantic import (
    balance_figures,
    brute_force_seconds,
    embedding_figures,
    memory_figures,
    semdedup_figures,
)
from prx_assets.stages.semantic.synthetic import planted_duplicates


def test_semdedup_figures_on_a_small_planted_set():
    figures = {f.metric: f for f in semdedup_figures(3000, baseline_rows=512)}
    assert figures["semdedup planted recall"].value >= 0.95
    assert figures["semdedup planted precision"].value >= 0.95
    assert figures["semdedup embeddings/s"].baseline_value > 0


def test_balance_and_memory_figures():
    balance = {f.metric: f.value for f in balance_figures(largest=800)}
    assert balance["balance fewest per leaf"] >= 1
    assert balance["balance flatter (x)"] > 1
    memory = memory_figures([2000, 4000])
    assert [f.baseline_value for f in memory] == [memory[0].value] * 2


def test_brute_force_time_is_scaled_up_from_the_measured_rows():
    vectors = planted_duplicates(2048, dim=16).vectors
    assert brute_force_seconds(vectors, 512) > 0


def test_image_embeddings_figures_on_a_few_images(ray_session):
    figures = {f.metric: f for f in embedding_figures(12, side=32, batch=4)}
    marginal = figures["embed images/s marginal (tiny CLIP)"]
    end_to_end = figures["embed images/s end to end (tiny CLIP)"]
    assert marginal.value > 0 and marginal.baseline_value > 0
    assert end_to_end.baseline_value == marginal.baseline_value
    # Both stage runs wrote every image (else the bench raises); end to end pays the
    # fixed costs on 12 images, far slower than a bare loop.
    assert 0 < end_to_end.value < end_to_end.baseline_value

