"""The demo funnel's "skipped" counts what the loader skips by default: not `balance`."""

from prx_assets.demo import funnel as demo_funnel
from prx_assets.stages.report import funnel
from prx_assets.stages.report.funnel import skipped_in_tree
from prx_assets.storage.refs import as_location
from prx_assets.storage.sidecars import write_sidecar


def test_opt_in_balance_is_not_counted_as_skipped(tmp_path):
    leaf = tmp_path / "512" / "512x512"
    leaf.mkdir(parents=True)
    write_sidecar(leaf / "shard.00000.skip.json",
                  {"dedup": [0, 1], "semdedup": [1, 2], "balance": [3, 4, 5]})
    assert skipped_in_tree(as_location(tmp_path)) == 3


def test_the_demo_module_still_offers_the_funnel():
    assert demo_funnel.source_funnel is funnel.source_funnel
    assert demo_funnel.Funnel is funnel.Funnel
