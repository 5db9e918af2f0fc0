"""Run the whole graph partition by partition in this process, on the configured instance."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import dagster as dg

from prx_assets.core import ray_runtime
from prx_assets.core.lance_tables import table_uri
from prx_assets.core.settings import data_root
from prx_assets.core.sources import load_sources
from prx_assets.defs import build_defs


@dataclass
class PartitionRun:
    source: str
    success: bool
    run_id: str
    metadata: dict = field(default_factory=dict)
    checks: dict = field(default_factory=dict)


def materialize_all(sources_file: Path, instance: dg.DagsterInstance | None = None
                    ) -> list[PartitionRun]:
    instance = instance or dg.DagsterInstance.get()
    defs = build_defs(sources_file)
    job = defs.resolve_job_def("corpus_job")
    ray_runtime.connect()  # one Ray for all partitions; resources reuse it
    runs = []
    for source in load_sources(sources_file).names:
        result = job.execute_in_process(partition_key=source, instance=instance,
                                        raise_on_error=False)
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
        if table_uri(data_root(), "mds_samples", source).exists():
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


def print_summary(runs: list[PartitionRun]) -> None:
    for run in runs:
        print(f"\n== source {run.source}: {'ok' if run.success else 'FAILED'} (run {run.run_id[:8]})")
        raw = run.metadata.get("raw_images", {})
        if raw:
            print(f"   raw_images: {raw.get('dagster/row_count')} rows, {raw.get('ok_rows')} ok, "
                  f"{raw.get('rejected_rows')} rejected, {raw.get('fragments')} fragment(s), "
                  f"lance version {raw.get('lance_version')}")
            print(f"   -> {raw.get('path')}")
        bucketed = run.metadata.get("bucketed_images", {})
        if bucketed:
            tiers = {r.data["tier"]: r.data["count"] for r in bucketed["images_per_tier"].records}
            print(f"   bucketed_images: {bucketed.get('kept')} kept "
                  f"({bucketed.get('kept_share', 0):.0%}), per tier {tiers}")
            print(f"   -> {bucketed.get('path')}")
        hashes = run.metadata.get("phashes", {})
        if hashes:
            print(f"   phashes: {hashes.get('dagster/row_count')} hashed, "
                  f"{hashes.get('flat_images')} flat -> {hashes.get('path')}")
        captions = run.metadata.get("captions", {})
        if captions:
            print(f"   captions: {captions.get('captioned_this_run')} new under version "
                  f"{captions.get('caption_version')} ({captions.get('model')}), coverage "
                  f"{captions.get('coverage', 0):.0%} -> {captions.get('path')}")
        labels = run.metadata.get("caption_labels", {})
        if labels:
            shares = {r.data["label"]: r.data["count"] for r in labels["label_shares"].records}
            print(f"   caption_labels: {labels.get('labelled_now')} labelled now "
                  f"({labels.get('captions_per_s')} captions/s), all: {shares}")
        corpus = run.metadata.get("corpus", {})
        if corpus:
            print(f"   corpus: {corpus.get('dagster/row_count')} rows -> {corpus.get('path')}; "
                  f"try `prx-assets search \"a few words\"`")
        dups = run.metadata.get("duplicates", {})
        if dups:
            print(f"   duplicates: {dups.get('removed')} copies removed in "
                  f"{dups.get('duplicate_groups')} groups -> {dups.get('path')}")
        skips = run.metadata.get("skip_lists", {})
        if skips:
            print(f"   skip_lists: {skips.get('skipped')} of {skips.get('samples')} samples "
                  f"skipped -> {skips.get('tree')}")
        for name, outcome in sorted(run.checks.items()):
            print(f"   check {name}: {outcome}")
    print("\nOpen the UI with `make ui` (http://127.0.0.1:3000) to see runs, checks and metadata.")
