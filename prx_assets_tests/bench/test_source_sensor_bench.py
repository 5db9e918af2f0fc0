"""`bench.source_sensor` on a small source: both timings are taken over the same files."""

from __future__ import annotations

from bench.source_sensor import measure


def test_the_sensor_bench_times_a_tick_and_a_bare_listing(tmp_path):
    (figure,) = measure(tmp_path, 2_000)
    assert figure.value > 0 and figure.baseline_value > 0
    assert "2,000 local files" in figure.metric and figure.baseline_name == "bare listing"
