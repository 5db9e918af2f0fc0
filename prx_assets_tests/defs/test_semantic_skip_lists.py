"""The skip_lists asset turns semantic_duplicates and concepts into the `semdedup` and
`balance` reasons of a source's sidecars (each switchable in its config)."""

import dagster as dg
import pyarrow as pa

from prx_assets.defs.resources import (
    CaptionerResource,
    ClassifierResource,
    SourcesResource,
    StorageResource,
)
from prx_assets.defs.skip_lists import build_skip_lists_asset
from prx_assets.stages.semantic.semdedup import SEMANTIC_DUPLICATES_SCHEMA
from prx_assets.stages.semantic.spaces import CONCEPTS_SCHEMA
from prx_assets.storage.lance_tables import overwrite_rows
from prx_assets.storage.layout import Storage
from prx_assets.storage.sidecars import read_sidecar
from prx_assets.testing.sources import write_sources

IDS = ["web:a", "web:b", "web:c", "web:d"]


def _write_tree(root):
    """A mapping table and shard files laid out as the shard writer does (one shard)."""
    rows = [
        {
            "id": i,
            "source": "web",
            "tier": 512,
            "width": 512,
            "height": 512,
            "leaf": "512/512x512",
            "shard": "shard.00000.mds",
            "sample_index": n,
            "tree_version": "t1",
        }
        for n, i in enumerate(IDS)
    ]
    shard = root / "mds" / "web" / "512/512x512" / "shard.00000.mds"
    shard.parent.mkdir(parents=True)
    shard.write_bytes(b"MDS shard")
    table = pa.Table.from_pylist(rows)
    overwrite_rows(Storage(root).table("mds_samples", "web"), table, table.schema)
    return shard.with_name("shard.00000.skip.json")


def test_semdedup_and_balance_reach_the_sidecars(data_root, tmp_path):
    sidecar = _write_tree(data_root)
    store = Storage(data_root)
    group = [
        {"id": i, "kept_id": "web:a", "group": 0, "group_size": 3, "cluster": 0,
         "similarity": 0.97, "applied": True}
        for i in ("web:a", "web:b", "stock:z")
    ]
    overwrite_rows(
        store.table("semantic_duplicates"),
        pa.Table.from_pylist(group, schema=SEMANTIC_DUPLICATES_SCHEMA),
        SEMANTIC_DUPLICATES_SCHEMA,
    )
    concepts = [
        {"id": i, "level": level, "cluster": 0, "balanced": i in ("web:a", "web:b")}
        for i in IDS
        for level in (1, 2)
    ]
    overwrite_rows(
        store.table("concepts"),
        pa.Table.from_pylist(concepts, schema=CONCEPTS_SCHEMA),
        CONCEPTS_SCHEMA,
    )
    sources = write_sources(
        tmp_path / "s.yaml", [f"{{name: web, kind: image_folder, uri: {tmp_path}}}"]
    )
    resources = {
        "sources": SourcesResource(path=str(sources)),
        "captioner": CaptionerResource(),
        "classifier": ClassifierResource(),
        "storage": StorageResource(),
    }
    asset = build_skip_lists_asset(dg.StaticPartitionsDefinition(["web"]))
    base = {"skip_labels": [], "opt_outs": False, "ablations": False}

    def run(**config):
        return dg.materialize(
            [asset],
            partition_key="web",
            resources=resources,
            run_config={"ops": {"skip_lists": {"config": {**base, **config}}}},
        )

    result = run()
    assert read_sidecar(sidecar) == {"semdedup": [1], "balance": [2, 3]}
    meta = result.get_asset_materialization_events()[0].materialization.metadata
    assert meta["input_version/semantic_duplicates"].value >= 1
    assert meta["input_version/concepts"].value >= 1
    reasons = {
        r.data["reason"]: r.data["skipped"] for r in meta["skipped_per_reason"].value.records
    }
    assert reasons == {"semdedup": 1, "balance": 2}
    run(balance=False)
    assert read_sidecar(sidecar) == {"semdedup": [1]}
    run(semdedup=False, balance=False)
    assert read_sidecar(sidecar) == {}
