"""Run the whole graph partition by partition in this process, on the configured instance."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dagster as dg
import pyarrow.compute as pc

from prx_assets.definitions import build_defs, default_subsets_file
from prx_assets.defs.executor import execute_in_process
from prx_assets.defs.report import tag_run_with_warnings
from prx_assets.demo.console import short_console_logger, wrap
from prx_assets.engine import ray_runtime
from prx_assets.registry import JOBS, PER_SOURCE, SUBSET, Job
from prx_assets.stages.ingest.sources import load_sources
from prx_assets.stages.report.funnel import format_funnel, source_funnel
from prx_assets.stages.shards.card import CARD_MD
from prx_assets.stages.subsets.definitions import load_subsets
from prx_assets.stages.subsets.tree import subset_store
from prx_assets.storage.layout import Storage
from prx_assets.storage.tables import (
    CONCEPTS,
    CORPUS,
    DUPLICATES,
    MDS_SAMPLES,
    SEMANTIC_DUPLICATES,
    SUBSETS,
)

# The console shows INFO and above (progress lines, warnings, failures): Dagster's DEBUG
# events (step starts, handled outputs, ...) are two thirds of what a run prints. The run's
# event log in the instance keeps every event whatever the console shows.
CONSOLE_LEVEL = "INFO"

# Checks that warn on the demo's own data, and why: what a new user reads under the warning.
# A check with an explainer (EXPLAINERS) is explained from what tripped it, per run instead.
DEMO_NOTES = {
    "caption_labels:label_shares":
        "not expected on the demo (its captions are photos and abstract pictures): look at "
        "the captions so labelled with `make browse` (/?label=nsfw); bounds: LabelSharesConfig",
}
SKIPPED_SHARE = "skip_lists:skipped_share"


@dataclass
class PartitionRun:
    source: str
    success: bool
    run_id: str
    metadata: dict = field(default_factory=dict)
    checks: dict = field(default_factory=dict)
    # check -> what it measured, for checks that did not pass (their evaluation's
    # description, else its metadata)
    check_notes: dict = field(default_factory=dict)
    # check -> its metadata values, for checks that did not pass (what EXPLAINERS read)
    check_metadata: dict = field(default_factory=dict)


def with_console_level(run_config: dict | None, level: str = CONSOLE_LEVEL) -> dict:
    """`run_config` with the console logger at `level`, unless it sets its own loggers."""
    config = dict(run_config or {})
    config.setdefault("loggers", {"console": {"config": {"log_level": level}}})
    return config


def _run(job, instance: dg.DagsterInstance, run_config: dict | None = None,
         **kwargs) -> dg.ExecuteInProcessResult:
    """The job in this process with its own executor (as the daemon runs it), its console
    one short line per event (demo.console)."""
    job = job.with_logger_defs({"console": short_console_logger})
    result = execute_in_process(job, instance, run_config=with_console_level(run_config),
                                raise_on_error=False, **kwargs)
    # What the check_warnings_tag sensor does under `make ui`: the Runs page shows it.
    tag_run_with_warnings(instance, result.run_id)
    return result


def _partition_run(name: str, result: dg.ExecuteInProcessResult) -> PartitionRun:
    checks, notes = check_results(result)
    return PartitionRun(name, result.success, result.run_id,
                        _materialization_metadata(result), checks, notes,
                        failed_check_metadata(result))


def demo_jobs(semantic: bool) -> list[Job]:
    """The registry's jobs in its order; the semantic ones only with `semantic`."""
    return [job for job in JOBS if semantic or not job.semantic]


def materialize_all(sources_file: Path, instance: dg.DagsterInstance | None = None,
                    corpus_run_config: dict | None = None, semantic: bool = False,
                    job_run_configs: dict[str, dict] | None = None) -> list[PartitionRun]:
    """Every asset for every source, job by job in the registry's order: source_job per
    source (with `corpus_run_config`), then (with `semantic`) each source's embeddings and
    the semantic duplicates and concepts, dedup across sources, each source's skip lists,
    the corpus table and the first subset. `job_run_configs`: other jobs' run config, by
    job name."""
    instance = instance or dg.DagsterInstance.get()
    defs = build_defs(sources_file)
    ray_runtime.connect()  # one Ray for all partitions; resources reuse it
    sources = load_sources(sources_file).names
    runs: list[PartitionRun] = []
    for job in demo_jobs(semantic):
        for label, partition in _partitions(job, sources, sources_file, runs):
            config = (corpus_run_config if job.name == "source_job"
                      else (job_run_configs or {}).get(job.name))
            runs.append(_partition_run(label, _run(defs.resolve_job_def(job.name), instance,
                                                   config, partition_key=partition)))
    return runs


def _partitions(job: Job, sources: list[str], sources_file: Path, runs: list[PartitionRun]
                ) -> list[tuple[str, str | None]]:
    """(label, partition) of each run of `job` the demo launches: per source (skip lists
    only where the source's MDS shards exist), once across sources (the corpus table only
    after every run so far succeeded: it spans every source), the first subset."""
    if job.partitioning == PER_SOURCE:
        if job.name == "skip_lists_job":
            sources = [s for s in sources if Storage.from_env().table(MDS_SAMPLES, s).exists()]
        return [(s if job.name == "source_job" else f"{s} ({job.name})", s) for s in sources]
    if job.partitioning == SUBSET:
        names = load_subsets(default_subsets_file(sources_file)).names
        return [(f"(subset {names[0]}: {job.name})", names[0])] if names else []
    if job.name == "corpus_table_job" and not (runs and all(run.success for run in runs)):
        return []
    return [(f"(all sources: {job.name})", None)]


def subset_card_lines(storage: Storage, runs: list[PartitionRun]) -> list[str]:
    """The card of each subset built, as its Markdown."""
    lines = []
    for run in runs:
        tree = run.metadata.get(SUBSETS, {})
        if not tree:
            continue
        name = run.source.split(" ")[1].rstrip(":")
        card = subset_store(storage.mds_root, name).current_tree() / CARD_MD
        lines += ["", f"== subset {name}: {tree.get('samples')} samples -> {tree.get('path')}",
                  f"   (prx-assets mds-uri --subset {name}; its card, {card}:)", "",
                  *card.read_text().splitlines()]
    return lines


def _materialization_metadata(result: dg.ExecuteInProcessResult) -> dict:
    metadata = {}
    for event in result.get_asset_materialization_events():
        mat = event.materialization
        metadata[mat.asset_key.to_user_string()] = {k: v.value for k, v in mat.metadata.items()}
    return metadata


def _check_evaluations(result: dg.ExecuteInProcessResult) -> Iterator[tuple[str, Any]]:
    """("asset:check", its evaluation) for each check evaluation of the run, in order."""
    for event in result.all_events:
        if event.event_type_value == "ASSET_CHECK_EVALUATION":
            evaluation = event.asset_check_evaluation_data
            yield f"{evaluation.asset_key.to_user_string()}:{evaluation.check_name}", evaluation


def check_results(result: dg.ExecuteInProcessResult) -> tuple[dict, dict]:
    """check -> "passed" or "failed (SEVERITY)", and check -> what a check that did not pass
    measured."""
    checks, notes = {}, {}
    for name, evaluation in _check_evaluations(result):
        checks[name] = ("passed" if evaluation.passed
                        else f"failed ({evaluation.severity.value})")
        if not evaluation.passed:
            notes[name] = evaluation.description or _measured(evaluation.metadata)
    return checks, notes


def failed_check_metadata(result: dg.ExecuteInProcessResult) -> dict:
    """check -> {entry: value} of each check evaluation that did not pass."""
    return {name: {k: v.value for k, v in evaluation.metadata.items()}
            for name, evaluation in _check_evaluations(result) if not evaluation.passed}


def skipped_share_explanation(metadata: Mapping) -> str | None:
    """Why skipped_share warned, from its metadata: the reasons skipped in the streams over
    the bound, whether those streams are so small that one sample crosses it, and the
    opt-in lists it did not count."""
    if "over_by_reason" not in metadata or "per_stream" not in metadata:
        return None
    bound = float(metadata["warn_above"])
    over = set(str(metadata["streams_over"]).split(", ")) - {"none"}
    sizes = [r.data["samples"] for r in metadata["per_stream"].records
             if r.data["stream"] in over]
    reasons = ", ".join(f"{reason} {n}" for reason, n in sorted(
        metadata["over_by_reason"].items(), key=lambda item: (-item[1], item[0])))
    parts = [f"tripped by {reasons or 'nothing'} in {len(over)} stream(s)"]
    tiny = [n for n in sizes if n and 1 / n > bound]
    if tiny:
        parts.append(f"{len(tiny)} of them hold {min(tiny)}-{max(tiny)} samples, where one "
                     f"skipped sample is over {bound:.0%}")
    per_reason = metadata.get("per_reason")
    opt_in = [f"{r.data['reason']} {r.data['samples']}"
              for r in (per_reason.records if per_reason is not None else [])
              if not r.data["applied"].startswith("by default")]
    if opt_in:
        parts.append(f"not counted: the opt-in {', '.join(opt_in)}")
    parts.append("a stream of real size over the bound: rewrite_shards_job "
                 "(bound: SkipShareConfig.warn_above)")
    return "; ".join(parts)


# Checks explained from their own metadata (what tripped them), per run.
EXPLAINERS = {SKIPPED_SHARE: skipped_share_explanation}


def _measured(metadata: Mapping[str, dg.MetadataValue]) -> str:
    """A check's plain metadata in one line, for checks that give no description."""
    plain = [f"{k} {v.value}" for k, v in metadata.items()
             if isinstance(v.value, (int, float, str)) and not k.startswith("dagster/")]
    return ", ".join(plain[:6])


def check_lines(runs: list[PartitionRun]) -> list[str]:
    """The closing summary of the checks: how many passed, then each check that did not,
    per run with what it measured, and once per check why the demo trips it."""
    checks = {(run.source, name): outcome for run in runs
              for name, outcome in run.checks.items()}
    notes = {(run.source, name): note for run in runs for name, note in run.check_notes.items()}
    explained = {(run.source, name): EXPLAINERS[name](metadata)
                 for run in runs for name, metadata in run.check_metadata.items()
                 if name in EXPLAINERS}
    failing = sorted(key for key, outcome in checks.items() if outcome != "passed")
    lines = [f"checks: {len(checks) - len(failing)} of {len(checks)} passed"
             + (f"; {len(failing)} did not:" if failing else "")]
    for check in sorted({name for _, name in failing}):
        lines.append(f"   {check}")
        for source, name in failing:
            if name == check:
                note = notes.get((source, name))
                lines.append(f"      {source}: {checks[(source, name)]}"
                             + (f": {note}" if note else ""))
                why = explained.get((source, name))
                if why:
                    lines.append(f"      -> {why}")
        if check in DEMO_NOTES:
            lines.append(f"      -> {DEMO_NOTES[check]}")
    return lines


def print_summary(runs: list[PartitionRun], sources_file: Path) -> None:
    """Per source: its runs, the funnel from raw files to streamed samples, where the outputs
    live; then the global assets, the checks that did not pass, and how to open the UI."""
    storage = Storage.from_env()
    resources = build_defs(sources_file).resources
    assert resources is not None  # build_defs binds the shared resources
    caption_version = resources["captioner"].caption_version()
    classifier_version = resources["classifier"].classifier_version()
    for source in load_sources(sources_file).names:
        mine = [run for run in runs if run.source.split(" ")[0] == source]
        outcome = "ok" if mine and all(run.success for run in mine) else "FAILED"
        print(f"\n== {source}: {outcome} (runs {', '.join(run.run_id[:8] for run in mine)})")
        for line in format_funnel(source_funnel(storage, source, caption_version,
                                                classifier_version)):
            print(line)
        print(f"   tables: {storage.root}/lance/<asset>/{source}.lance")
        print(f"   shards: {storage.mds_root / source}/<tier>/<W>x<H>/ (skip lists beside them)")
    print(f"\ncaption version {caption_version}, classifier version {classifier_version}")
    for run in runs:
        if not run.source.startswith("("):
            continue
        print(f"{run.source}: {'ok' if run.success else 'FAILED'} (run {run.run_id[:8]})")
        dups = run.metadata.get(DUPLICATES, {})
        if dups:
            print(f"   duplicates: {dups.get('removed')} copies removed in "
                  f"{dups.get('duplicate_groups')} groups -> {dups.get('path')}")
        semantic = run.metadata.get(SEMANTIC_DUPLICATES, {})
        if semantic:
            acted = ("skipped by semdedup" if semantic.get("applied_by_skip_lists")
                     else "reported only")
            print(f"   semantic duplicates: {semantic.get('removed')} of "
                  f"{semantic.get('embeddings')} at eps {semantic.get('eps')} ({acted})")
            print(f"      in the {semantic.get('space')}")
            why = semantic_explanation(semantic, distinct_captions(storage))
            if why:
                print("\n".join(wrap(f"      -> {why}")))
        concepts = run.metadata.get(CONCEPTS, {})
        if concepts:
            print(f"   concepts: clusters per level {concepts.get('levels')}; balanced sample "
                  f"{concepts.get('balanced_samples')} of {concepts.get('samples')} (largest/"
                  f"median leaf {concepts.get('largest_to_median_before')} -> "
                  f"{concepts.get('largest_to_median_after')})")
            why = balance_explanation(concepts)
            if why:
                print("\n".join(wrap(f"      -> {why}")))
        corpus = run.metadata.get(CORPUS, {})
        if corpus:
            print(f"   corpus: {corpus.get('dagster/row_count')} rows -> {corpus.get('path')}")
    for line in subset_card_lines(storage, runs):
        print(line)
    print()
    for line in check_lines(runs):
        print("\n".join(wrap(line)))
    for line in closing_lines():
        print(line)


def distinct_captions(storage: Storage) -> int | None:
    """Distinct captions among the corpus' samples (None without a corpus table); the
    column is read whole: the demo's corpus is a few hundred rows."""
    table = storage.table(CORPUS)
    if not table.exists():
        return None
    return len(pc.unique(table.to_table(columns=["caption"]).column("caption")))


def semantic_explanation(semantic: Mapping, captions: int | None) -> str | None:
    """Why a large semantic share is expected, from the figures: in the caption space an
    image is its caption, so samples that repeat a caption are one point, and captions
    worded alike fall within the eps."""
    removed, rows = semantic.get("removed"), semantic.get("embeddings")
    if not rows or removed is None or semantic.get("applied_by_skip_lists"):
        return None
    share = f"{removed / rows:.0%}"
    acted = ("reported only, nothing skipped: an image encoder (image_encoder.checkpoint) "
             "gives groups skip lists act on")
    if captions is None:
        return f"{share}: {acted}"
    repeats = min(removed, rows - captions)
    return (f"{share} because in the caption space an image is its caption: {repeats} of the "
            f"{removed} repeat another sample's caption word for word (crops of a few photos "
            f"share one), the other {removed - repeats} are worded within cosine "
            f"{1 - float(semantic.get('eps', 0)):.2f} of one; {acted}")


def balance_explanation(concepts: Mapping) -> str | None:
    """What the balance list is, from the figures: the samples the balanced sample leaves
    out, skipped only by a run that names it."""
    samples, kept = concepts.get("samples"), concepts.get("balanced_samples")
    if not samples or kept is None:
        return None
    return (f"the other {samples - kept} of {samples} make the opt-in `balance` list: the "
            f"loader skips them only when a run names it (skip_reasons=[..., \"balance\"]); "
            f"the grid marks them \"in the balance list, opt-in\"")


def closing_lines() -> list[str]:
    """What to do next, with the exact commands (each line short)."""
    return [
        "",
        "Next:",
        "   make ui        # Dagster at http://127.0.0.1:3000: runs, checks, each source's "
        "funnel",
        "   make browse    # the corpus browser at http://127.0.0.1:8080: images, captions, "
        "rejects",
        "   .venv/bin/prx-assets search \"a cat\"    # captions from the shell",
    ]
