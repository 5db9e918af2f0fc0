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


def test_a_sized_pool_has_an_actor_per_rows_per_actor_at_most_the_cpus(ray_session):
    """Sized by the cluster with the rows known: one actor per ROWS_PER_ACTOR rows, all
    started at once, at most one per CPU (the session has 2)."""
    from prx_assets.engine.batches import ROWS_PER_ACTOR, actor_pool

    few = actor_pool(0, 1, pending=ROWS_PER_ACTOR + 1)
    assert (few.initial_size, few.max_size) == (1, 1)  # a second model load for a batch
    many = actor_pool(0, 1, pending=10 * ROWS_PER_ACTOR)
    assert (many.initial_size, many.max_size) == (2, 2)
    unknown = actor_pool(0, 1)
    assert (unknown.initial_size, unknown.max_size) == (1, 2)


def test_model_steps_running_together_share_the_cpus(ray_session):
    """Two model steps at once (a run's caption_labels and attributes): one actor each on
    2 CPUs, not two each; alone again, two."""
    from prx_assets.engine.batches import ROWS_PER_ACTOR, actor_pool, model_step

    rows = 4 * ROWS_PER_ACTOR  # 2,000: the bench's run
    with model_step():
        assert actor_pool(0, 1, pending=rows).max_size == 2
        with model_step():
            shared = actor_pool(0, 1, pending=rows)
            assert (shared.initial_size, shared.max_size) == (1, 1)
    with model_step():
        assert actor_pool(0, 1, pending=rows).max_size == 2
