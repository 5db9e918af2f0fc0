"""The registry is the pipeline's order: it must be the Dagster asset graph's, so a stage
registered before one it reads (or with other upstreams than it declares) fails here."""

import shutil
from pathlib import Path

import dagster as dg
import pytest

from prx_assets.definitions import build_defs
from prx_assets.defs.factory import AUTOMATED
from prx_assets.demo.runner import demo_jobs
from prx_assets.registry import GLOBAL, JOBS, PER_SOURCE, STEPS, SUBSET, automated
from prx_assets.storage import tables
from prx_assets.testing.sources import write_sources

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def graph(tmp_path_factory) -> dg.Definitions:
    folder = tmp_path_factory.mktemp("registry")
    (folder / "imgs").mkdir()
    sources = write_sources(folder / "s.yaml", [
        f"{{name: web, kind: image_folder, uri: {folder / 'imgs'}}}"])
    shutil.copy(REPO / "subsets.yaml", folder / "subsets.yaml")  # so the subsets asset exists
    return build_defs(sources)


def test_every_asset_is_registered_with_the_graph_s_upstreams(graph):
    assets = graph.resolve_asset_graph()
    names = {key.to_user_string() for key in assets.get_all_asset_keys()}
    assert [s.asset for s in STEPS if s.asset not in names] == []
    assert names == {s.asset for s in STEPS}
    for step in STEPS:
        parents = {k.to_user_string() for k in assets.get(dg.AssetKey(step.asset)).parent_keys}
        assert set(step.upstream) == parents, step.asset


def test_the_registry_s_order_follows_the_graph():
    """Each step comes after every step it reads (checked on the registry: its upstreams
    are the graph's, above)."""
    seen: set[str] = set()
    for step in STEPS:
        assert set(step.upstream) <= seen, f"{step.asset} registered before {step.upstream}"
        seen.add(step.asset)


def test_partitioning_is_the_graph_s_and_the_layout_s(graph):
    assets = graph.resolve_asset_graph()
    for step in STEPS:
        partitions = assets.get(dg.AssetKey(step.asset)).partitions_def
        if step.partitioning == GLOBAL:
            assert partitions is None, step.asset
        else:
            keys = partitions.get_partition_keys() if partitions else []
            assert keys == (["web"] if step.partitioning == PER_SOURCE else keys) and keys, \
                step.asset
        if step.asset in tables.PER_SOURCE:
            assert step.partitioning == PER_SOURCE, step.asset
        if step.asset in tables.GLOBAL:
            assert step.partitioning == GLOBAL, step.asset


def test_jobs_automation_and_the_demo_follow_the_registry(graph):
    for job in JOBS:
        if job.partitioning == SUBSET:
            continue
        selected = graph.resolve_job_def(job.name).asset_layer.selected_asset_keys
        assert {k.to_user_string() for k in selected} == set(job.assets), job.name
    assert {a for job in JOBS for a in job.assets} == {s.asset for s in STEPS}
    assert automated() == AUTOMATED
    automatic = [k.to_user_string() for k in graph.resolve_asset_graph().toposorted_asset_keys
                 if graph.resolve_asset_graph().get(k).automation_condition is not None]
    assert set(automatic) == set(automated())
    assert [job.name for job in demo_jobs(semantic=True)] == [job.name for job in JOBS]
    assert "embeddings_job" not in [job.name for job in demo_jobs(semantic=False)]
