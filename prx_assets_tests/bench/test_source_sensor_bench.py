"""`bench.source_sensor` on a small source: both timings are taken over the same files."""

from __future__ import annotations

import pytest

from bench.source_sensor import measure, measure_s3


def test_the_sensor_bench_times_a_tick_and_a_bare_listing(tmp_path):
    (figure,) = measure(tmp_path, 2_000)
    assert figure.value > 0 and figure.baseline_value > 0
    assert "2,000 local files" in figure.metric and figure.baseline_name == "bare listing"


@pytest.mark.s3  # measure_s3 starts its own S3 server
def test_the_sensor_bench_on_the_s3_server_lists_the_same_objects_both_ways(tmp_path):
    (figure,) = measure_s3(tmp_path, 200)
    assert figure.value > 0 and figure.baseline_value > 0
    assert "200 objects on the S3 test server" in figure.metric
