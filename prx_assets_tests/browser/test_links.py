"""Links from the browser into Dagster: the exact run that wrote a row, else the asset."""

from datetime import UTC, datetime

import dagster as dg

from prx_assets.browser.links import run_url

PARTITIONS = dg.StaticPartitionsDefinition(["web", "stock"])


@dg.asset(name="captions", partitions_def=PARTITIONS)
def captions_asset() -> None:
    return None


def test_a_row_links_to_the_first_run_that_materialised_its_partition_after_it(monkeypatch):
    monkeypatch.setenv("PRX_DAGSTER_URL", "http://ui:3000")
    instance = dg.DagsterInstance.ephemeral()
    before_first = datetime.now(UTC)
    first = dg.materialize([captions_asset], instance=instance, partition_key="web")
    dg.materialize([captions_asset], instance=instance, partition_key="stock")
    between = datetime.now(UTC)
    second = dg.materialize([captions_asset], instance=instance, partition_key="web")

    assert run_url("captions", "web", before_first, instance) == (
        f"http://ui:3000/runs/{first.run_id}")
    assert run_url("captions", "web", between, instance) == f"http://ui:3000/runs/{second.run_id}"
    # Written after every run (a corpus built elsewhere), or no instance: the asset page.
    asset_page = "http://ui:3000/assets/captions?partition=web"
    assert run_url("captions", "web", datetime.now(UTC), instance) == asset_page
    assert run_url("captions", "web", before_first, None) == asset_page
