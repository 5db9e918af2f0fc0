"""The loader fails closed: a recorded opt-out is never streamed, even when the sidecar that
should skip it is missing (a build that published shards without sidecars) or stale (the
mapping that placed it is older than the tree)."""

import pyarrow as pa
import pytest

from prx_assets.loader import build_dataset
from prx_assets.stages.shards import mds, plan
from prx_assets.storage.lance_tables import overwrite_rows
from prx_assets.storage.layout import Storage
from prx_assets.testing.mds_corpus import build_corpus, inputs_for
from prx_assets.testing.opt_outs import opt_out, record_opt_outs, write_raw_ids

SHAPES = ((1, 48, 48), (1, 48, 64))


pytestmark = pytest.mark.usefixtures("fresh_shared_memory")


@pytest.fixture()
def tree(tmp_path):
    """One source's tree with no sidecar at all (what a build without skip_lists left)."""
    root = tmp_path / "data"
    build_corpus(root, "web", per_shape=8, shapes=SHAPES)
    mds.write_mds_tree(inputs_for(root, "web"), root, "web",
                       plan.WriteOptions(size_limit=4_000, parallel=False))
    mapping = Storage(root).table("mds_samples", "web").to_table().to_pylist()
    ids = sorted(r["id"] for r in mapping)
    write_raw_ids(root, "web", ids)
    assert not list((root / "mds").rglob("*.skip.json"))
    return root, ids


def streamed(root, **kwargs) -> list[str]:
    dataset = build_dataset(root / "mds", 1, 1, weights={"web": 1.0}, shuffle=False,
                            decode_images=False, **kwargs)
    return [sample["id"] for sample in dataset]


def test_an_opt_out_without_its_sidecar_is_not_streamed(tree):
    root, ids = tree
    assert sorted(streamed(root)) == ids
    opt_out(root, "a.jsonl", ids[3])
    dataset = build_dataset(root / "mds", 1, 1, weights={"web": 1.0}, shuffle=False,
                            decode_images=False)
    got = [sample["id"] for sample in dataset]
    assert sorted(got) == [i for i in ids if i != ids[3]]
    assert dataset.opt_outs_guarded == 1 and dataset.opt_outs_dropped == 0
    assert len(dataset) == len(ids) - 1  # skipped before partitioning, like a sidecar
    # Without the guard (what the sidecars alone give): the leak the guard closes.
    assert ids[3] in streamed(root, guard_opt_outs=False)


def test_a_copy_opted_out_in_another_source_is_not_streamed(tree):
    """A phash copy of an image opted out elsewhere is skipped (duplicates table)."""
    root, ids = tree
    write_raw_ids(root, "stock", ["stock:orig"])
    groups = pa.table({"id": ["stock:orig", ids[5]], "phash": pa.array([7, 7], pa.int64()),
                       "kept_id": ["stock:orig", "stock:orig"]})
    overwrite_rows(Storage(root).table("duplicates"), groups, groups.schema)
    opt_out(root, "b.jsonl", "stock:orig")
    assert ids[5] not in streamed(root)


def test_a_mapping_older_than_the_tree_still_drops_by_id(tree):
    """The mapping places the opt-out on the wrong sample (as for a loader opened on a tree
    the mapping no longer describes): the id check on each sample still drops it."""
    root, ids = tree
    table = Storage(root).table("mds_samples", "web")
    rows = table.to_table().to_pylist()
    by_id = {r["id"]: r for r in rows}
    victim, other = by_id[ids[2]], by_id[ids[6]]
    swapped = {k: victim[k] for k in ("leaf", "shard", "sample_index")}
    victim.update({k: other[k] for k in swapped})
    other.update(swapped)
    overwrite_rows(table, pa.Table.from_pylist(rows, schema=table.open().schema),
                   table.open().schema)
    opt_out(root, "c.jsonl", ids[2])
    dataset = build_dataset(root / "mds", 1, 1, weights={"web": 1.0}, shuffle=False,
                            decode_images=False)
    got = [sample["id"] for sample in dataset]
    assert ids[2] not in got and dataset.opt_outs_dropped == 1
    assert dataset.rights_dropped == 0


def test_a_request_dropped_after_the_tables_resolution_still_blocks_its_id(tree):
    """The guard reads the audited `opt_outs` table; a request file that landed after the
    table's resolution is not in it, and is resolved when the loader opens the trees."""
    root, ids = tree
    opt_out(root, "a.jsonl", ids[3])
    record_opt_outs(root)
    opt_out(root, "b.jsonl", ids[5])
    storage = Storage(root)
    recorded = storage.table("opt_outs").to_table().column("id").to_pylist()
    assert ids[3] in recorded and ids[5] not in recorded
    dataset = build_dataset(root / "mds", 1, 1, weights={"web": 1.0}, shuffle=False,
                            decode_images=False)
    got = [sample["id"] for sample in dataset]
    assert sorted(got) == [i for i in ids if i not in (ids[3], ids[5])]
    assert dataset.opt_outs_guarded == 2


def test_a_reserved_sample_without_its_sidecar_is_not_streamed(tree):
    """Skip reason `rights` fails closed like an opt-out: prohibited, on a listed domain,
    or constrained and not cleared (a clearance brings a constrained one back)."""
    from prx_assets.stages.opt_outs.rights import clear, domains_dir

    root, ids = tree
    reservation = {ids[1]: "prohibited", ids[2]: "constrained"}
    url = {ids[5]: "https://img.reserved.example/5.jpg"}
    raw = pa.table({"id": ids, "url": [url.get(i) for i in ids],
                    "reservation": [reservation.get(i, "none") for i in ids],
                    "reservation_signal": [reservation.get(i) for i in ids]})
    overwrite_rows(Storage(root).table("raw_images", "web"), raw, raw.schema)
    (domains_dir(Storage(root)) / "list.txt").write_text("reserved.example\n")
    assert sorted(streamed(root)) == [i for i in ids if i not in (ids[1], ids[2], ids[5])]
    clear(Storage(root), [ids[1], ids[2]], "terms read", door="cli")
    assert sorted(streamed(root)) == [i for i in ids if i not in (ids[1], ids[5])]
    assert {ids[1], ids[5]} <= set(streamed(root, guard_opt_outs=False))
    # Counted apart: withheld for their rights, and opted out (a sample both is an opt-out).
    dataset = build_dataset(root / "mds", 1, 1, weights={"web": 1.0}, shuffle=False,
                            decode_images=False)
    assert (dataset.opt_outs_guarded, dataset.rights_guarded) == (0, 2)
    opt_out(root, "r.jsonl", ids[1])
    dataset = build_dataset(root / "mds", 1, 1, weights={"web": 1.0}, shuffle=False,
                            decode_images=False)
    assert (dataset.opt_outs_guarded, dataset.rights_guarded) == (1, 1)
