"""`bench.plan_growth` on a tiny source: the tables it makes give the planner a delta of the
intended size, every phase measures, and the figures compare sizes and codes."""

from __future__ import annotations

from bench.plan_growth import figures, inputs_of, make_source, measure_phase
from prx_assets.stages.shards.mapping import mapping_for_append
from prx_assets.stages.shards.plan import plan_delta, plan_samples
from prx_assets.storage.refs import TableRef


def test_the_source_has_a_small_delta_and_every_phase_measures(tmp_path):
    make_source(tmp_path, 2_000)
    plan, left_out = plan_samples(inputs_of(tmp_path))
    assert plan.num_rows == 2_000 and not left_out
    previous = mapping_for_append(TableRef.of(tmp_path / "mapping.lance"))
    assert previous is not None
    delta = plan_delta(plan, previous)
    assert delta.write.num_rows == 2  # 0.1 % changed fingerprints
    assert delta.stale.num_rows == 4 and len(delta.removed_ids) == 2  # changed + gone
    for phase in ("plan", "diff", "handed", "compared", "skipped"):
        result = measure_phase(phase, tmp_path, warm=tmp_path)
        assert result["seconds"] > 0 and result["python_bytes"] > 0


def test_figures_compare_sizes_then_codes():
    one = {"seconds": 1.0, "rss_kb": 1024, "python_bytes": 2**20}
    two = {"seconds": 20.0, "rss_kb": 2048, "python_bytes": 2**21}
    results = {"this": {"plan": {10: one, 100: two}}, "before": {"plan": {10: two, 100: two}}}
    lines = {f.metric: f.ratio for f in figures(results)}
    assert lines["this plan @1e+02 us/row"] == 2.0  # 200 us/row against 100
    assert lines["this plan @1e+02 py peak"] == 2.0
    assert lines["plan @1e+01 before s"] == 20.0  # the other code against the first


def test_the_handed_diff_is_compared_with_the_plan_and_the_diff_it_replaces():
    one = {"seconds": 1.0, "rss_kb": 1024, "python_bytes": 2**20}
    results = {"this": {"plan": {10: one}, "diff": {10: one},
                        "handed": {10: {**one, "seconds": 0.5}}}}
    lines = {f.metric: f.ratio for f in figures(results)}
    assert lines["this handed vs plan+diff @1e+01 s"] == 0.25  # 0.5 s against 1 + 1
    assert lines["this handed vs plan+diff @1e+01 rss peak"] == 1.0


def test_the_grouped_compare_is_compared_with_the_plan_and_the_diff_it_replaces():
    one = {"seconds": 1.0, "rss_kb": 1024, "python_bytes": 2**20}
    results = {"this": {"plan": {10: one}, "diff": {10: {**one, "rss_kb": 4096}},
                        "compared": {10: {**one, "seconds": 3.0}}}}
    lines = {f.metric: f.ratio for f in figures(results)}
    assert lines["this compared vs plan+diff @1e+01 s"] == 1.5  # 3 s against 1 + 1
    assert lines["this compared vs plan+diff @1e+01 rss peak"] == 0.25  # against the diff's
