"""The soak's disk measure in a bucket: every object counts, the live versions' apart."""

from __future__ import annotations

from bench.soak_probes import listed_versions, version_bytes


def test_every_object_counts_and_only_the_live_versions_are_live():
    sizes = {"v1/512/640x480/shard.00000.mds": 100, "v1/512/640x480/index.json": 5,
             "v2/512/640x480/shard.00000.mds": 100,  # carried: a copy, not a link
             "v2/512/640x480/index.json": 5, "v3/256/320x240/shard.00000.mds": 40,
             "mapped_leaves.json": 7}  # the folder's own file: never live
    assert version_bytes(sizes, {"v2"}) == (257, 105)
    assert version_bytes(sizes, ["v1", "v3"]) == (257, 145)
    assert version_bytes(sizes, set()) == (257, 0)


def test_a_version_is_the_first_part_of_the_path_not_a_prefix_of_it():
    sizes = {"v1/a.mds": 10, "v10/a.mds": 20, "v1.partial/a.mds": 30}
    assert version_bytes(sizes, {"v1"}) == (60, 10)


def test_the_versions_listed_are_those_holding_a_file_not_the_folders_own_files():
    assert listed_versions({"v1/512/640x480/a.mds": 1, "v2/tree.json": 2,
                            "mapped_leaves.json": 3}) == {"v1", "v2"}
    assert listed_versions({}) == set()


def test_a_failed_runs_cause_is_its_first_failed_step_and_error_line():
    import dagster as dg

    from bench.soak_probes import failure_cause

    @dg.asset
    def fine() -> int:
        return 1

    @dg.asset
    def broken(fine: int) -> int:
        raise RuntimeError(f"lease held by another run\nsecond line {fine}")

    with dg.instance_for_test() as instance:
        failed = dg.materialize([fine, broken], instance=instance, raise_on_error=False)
        assert failure_cause(instance, failed.run_id).startswith(
            "broken: RuntimeError: lease held by another run")
        passed = dg.materialize([fine], instance=instance)
        assert failure_cause(instance, passed.run_id) == ""


def test_a_runs_step_retries_are_counted():
    import dagster as dg

    from bench.soak_probes import step_retries

    @dg.asset
    def transient(context) -> int:  # a local dg: the annotation could not resolve
        if context.retry_number == 0:
            raise dg.RetryRequested(max_retries=1)
        return 1

    with dg.instance_for_test() as instance:
        assert step_retries(instance, dg.materialize([transient], instance=instance).run_id) == 1
