"""How many rows one ingest run may remove."""

from prx_assets.stages.ingest.removals import RemovalLimit


def test_a_run_may_remove_up_to_the_floor_or_up_to_the_share():
    limit = RemovalLimit(share=0.10, floor_rows=100)
    assert limit.allows(100, 120)  # the floor: a handful from a small table
    assert not limit.allows(101, 120)
    assert limit.allows(1_000, 10_000) and not limit.allows(1_001, 10_000)  # the share
