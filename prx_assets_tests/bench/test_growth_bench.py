"""`bench.growth` on tiny partitions: every figure is measured and the writes it times
leave what the stages would (each id once, the +0.1 % appended, the −0.1 % deleted,
nothing doubled)."""

from __future__ import annotations

from bench.growth import figures, parse_sizes, run


def test_sizes_accept_powers_of_ten():
    assert parse_sizes("1e4, 1e3,1e4") == [1_000, 10_000]


def test_a_tiny_growth_run_measures_every_figure(ray_session):
    runs = run([400, 800], baseline_max=400, chunk_rows=128)
    small, large = runs
    assert small.details["append"]["appended"] == 400  # known new: appended, no lookup
    assert small.details["append"]["commits"] == 4  # ceil(400 / 128)
    # +0.1 % of 800 (at least one row), handed over by upstream: offered and written once.
    assert large.details["rerun"] == {"committed": 1, "offered": 1}
    # −0.1 %: the first id left upstream; 800 + 1 held, 800 left.
    assert large.details["shrink"] == {"deleted": 1, "live": 800}
    # The same without upstream's changes: 801 ids offered, 1 new; then 1 of 801 gone.
    assert large.details["full_rerun"] == {"committed": 1}
    assert large.details["full_shrink"] == {"deleted": 1, "live": 800}
    assert all(r.append_s > 0 and r.merge_s > 0 and r.driver_kb > 0 for r in runs)
    assert small.unindexed_merge_s is not None and large.unindexed_merge_s is None
    assert small.scanned_merge_keys_s is not None and large.scanned_merge_keys_s is None
    assert all(r.merge_keys_s > 0 for r in runs)
    assert large.disk_per_live_freed < large.disk_per_live  # the grace cleanup frees files
    lines = [f.line() for f in figures(runs)]
    assert len(lines) == 2 * 11 + 2  # two baseline lines: only the small size ran them
    assert any("merge, key index @4e+02" in line and "merge without index" in line
               for line in lines)
    assert any("merge on 2 keys, looked up @4e+02" in line for line in lines)
