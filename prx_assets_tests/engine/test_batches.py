import pyarrow as pa

from prx_assets.engine.batches import arrow_batches, dataset_of, put_table


def test_a_dataset_of_put_tables_is_what_from_arrow_refs_makes(ray_session):
    import ray.data

    tables = [pa.table({"unit": ["a", "b"], "n": [1, 2]}), pa.table({"unit": ["c"], "n": [3]})]
    put = [put_table(t) for t in tables]
    ours = dataset_of(put)
    theirs = ray.data.from_arrow_refs([p.ref for p in put])
    assert ours.count() == theirs.count() == 3
    assert ours.schema() == theirs.schema()
    assert ours.num_blocks() == theirs.num_blocks() == 2
    rows = pa.concat_tables(arrow_batches(ours, batch_size=None))
    assert rows.to_pylist() == pa.concat_tables(tables).to_pylist()
