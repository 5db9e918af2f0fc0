"""The SemDeDup profile's records: one per task call, summed by kind."""

import json

from bench.semdedup_profile import by_kind, profiled, top_functions


def test_each_call_leaves_a_record_summed_by_kind(tmp_path):
    def work(n: int) -> int:
        return sum(i * i for i in range(n))

    fit = profiled("fit", work, str(tmp_path), with_cprofile=True)
    route = profiled("route", work, str(tmp_path), with_cprofile=False)
    assert fit(10_000) == route(10_000) == work(10_000)
    route(10)
    kinds = by_kind(tmp_path)
    assert sorted(kinds) == ["fit", "route"]
    assert kinds["fit"][0] == 1 and kinds["route"][0] == 2
    assert all(json.loads(p.read_text())["cpu"] >= 0 for p in tmp_path.glob("*.json"))
    assert "genexpr" in top_functions(tmp_path, "fit")
    assert top_functions(tmp_path, "route") == ""  # no cProfile asked
