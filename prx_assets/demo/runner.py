"""Run the whole graph partition by partition in this process, on the configured instance."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import dagster as dg

from prx_assets.engine import ray_runtime
from prx_assets.demo.funnel import format_funnel, source_funnel
from prx_assets.storage.layout import Storage
from prx_assets.storage.tables import CORPUS, DUPLICATES, MDS_SAMPLES
from prx_assets.s1_ingest.sources import load_sources
from prx_assets.definitions import build_defs


@dataclass
class PartitionRun:
    source: str
    success: bool
    run_id: str
    metadata: dict = field(default_factory=dict)
    checks: dict = field(default_factory=dict)


def materialize_all(sources_file: Path, instance: dg.DagsterInstance | None = None,
                    corpus_run_config: dict | None = None) -> list[PartitionRun]:
    """Every asset for every source: corpus_job per source (with `corpus_run_config`), then
    dedup across sources, each source's skip lists, and the corpus table."""
    instance = instance or dg.DagsterInstance.get()
    defs = build_defs(sources_file)
    job = defs.resolve_job_def("corpus_job")
    ray_runtime.connect()  # one Ray for all partitions; resources reuse it
    runs = []
    for source in load_sources(sources_file).names:
        result = job.execute_in_process(partition_key=source, instance=instance,
                                        run_config=corpus_run_config, raise_on_error=False)
        runs.append(PartitionRun(source, result.success, result.run_id,
                                 _materialization_metadata(result), _check_results(result)))
    runs += _after_all_sources(defs, instance, load_sources(sources_file).names)
    if runs and all(run.success for run in runs):  # the corpus table spans every source
        result = defs.resolve_job_def("corpus_table_job").execute_in_process(
            instance=instance, raise_on_error=False)
        runs.append(PartitionRun("(all sources: corpus_table_job)", result.success,
                                 result.run_id, _materialization_metadata(result),
                                 _check_results(result)))
    return runs


def _after_all_sources(defs: dg.Definitions, instance: dg.DagsterInstance,
                       sources: list[str]) -> list[PartitionRun]:
    """Global dedup (needs every source's hashes), then each source's skip lists where its
    MDS shards exist."""
    result = defs.resolve_job_def("dedup_job").execute_in_process(instance=instance,
                                                                  raise_on_error=False)
    runs = [PartitionRun("(all sources: dedup_job)", result.success, result.run_id,
                         _materialization_metadata(result), _check_results(result))]
    for source in sources:
        if Storage.from_env().exists(MDS_SAMPLES, source):
            result = defs.resolve_job_def("skip_lists_job").execute_in_process(
                partition_key=source, instance=instance, raise_on_error=False)
            runs.append(PartitionRun(f"{source} (skip_lists_job)", result.success,
                                     result.run_id, _materialization_metadata(result),
                                     _check_results(result)))
    return runs


def _materialization_metadata(result: dg.ExecuteInProcessResult) -> dict:
    metadata = {}
    for event in result.get_asset_materialization_events():
        mat = event.event_specific_data.materialization
        metadata[mat.asset_key.to_user_string()] = {k: v.value for k, v in mat.metadata.items()}
    return metadata


def _check_results(result: dg.ExecuteInProcessResult) -> dict:
    checks = {}
    for event in result.all_events:
        if event.event_type_value == "ASSET_CHECK_EVALUATION":
            evaluation = event.event_specific_data
            checks[f"{evaluation.asset_key.to_user_string()}:{evaluation.check_name}"] = (
                "passed" if evaluation.passed else f"failed ({evaluation.severity.value})")
    return checks


def print_summary(runs: list[PartitionRun], sources_file: Path) -> None:
    """Per source: its runs, the funnel from raw files to streamed samples, where the outputs
    live; then the global assets, the checks that did not pass, and how to open the UI."""
    storage = Storage.from_env()
    defs = build_defs(sources_file)
    caption_version = defs.resources["captioner"].caption_version()
    classifier_version = defs.resources["classifier"].classifier_version()
    for source in load_sources(sources_file).names:
        mine = [run for run in runs if run.source.split(" ")[0] == source]
        outcome = "ok" if mine and all(run.success for run in mine) else "FAILED"
        print(f"\n== {source}: {outcome} (runs {', '.join(run.run_id[:8] for run in mine)})")
        for line in format_funnel(source_funnel(storage, source, caption_version,
                                                classifier_version)):
            print(line)
        print(f"   tables: {storage.root}/lance/<asset>/{source}.lance")
        print(f"   shards: {storage.mds_tree(source)}/<tier>/<W>x<H>/ (skip lists beside them)")
    print(f"\ncaption version {caption_version}, classifier version {classifier_version}")
    for run in runs:
        if not run.source.startswith("("):
            continue
        print(f"{run.source}: {'ok' if run.success else 'FAILED'} (run {run.run_id[:8]})")
        dups = run.metadata.get(DUPLICATES, {})
        if dups:
            print(f"   duplicates: {dups.get('removed')} copies removed in "
                  f"{dups.get('duplicate_groups')} groups -> {dups.get('path')}")
        corpus = run.metadata.get(CORPUS, {})
        if corpus:
            print(f"   corpus: {corpus.get('dagster/row_count')} rows -> {corpus.get('path')}; "
                  f"try `prx-assets search \"a cat\"`")
    checks = {f"{run.source}: {name}": outcome for run in runs
              for name, outcome in run.checks.items()}
    failing = {name: outcome for name, outcome in sorted(checks.items()) if outcome != "passed"}
    print(f"\nchecks: {len(checks) - len(failing)} of {len(checks)} passed")
    for name, outcome in failing.items():
        print(f"   {name}: {outcome}")
    print("\nOpen the UI with `make ui` (http://127.0.0.1:3000): every run, check and metadata "
          "table above is there, per source partition.")
