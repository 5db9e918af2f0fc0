"""The fault tests' store and checks: a small corpus of three image-folder sources run once
through the graph (in process, on the session's Ray), runs of it killed at a failpoint in a
subprocess (`fault_runs`), and the assertions that a source's tables hold exactly what its
files call for.

Chunks are small (four rows, captions two) rather than corpora large: a kill after the
first committed chunk needs only a second chunk still pending.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import dagster as dg
import lance
from PIL import Image

from prx_assets.definitions import build_defs
from prx_assets.defs.images import ImageStageConfig
from prx_assets.stages.images.stage import settings_fingerprint
from prx_assets.stages.ingest.ids import sample_id
from prx_assets.stages.shards.verify import verify_tree
from prx_assets.testing.fault_runs import (
    RunProcess,
    RunSpec,
    mark_killed_run_failed,
    materialized_in_run,
    open_instance,
    run_in_process,
    step_started,
    wait_for_failpoint,
    write_instance_config,
)
from prx_assets.testing.images import jpeg_bytes
from prx_assets.testing.sources import write_sources

REPO = Path(__file__).resolve().parents[2]
STAGE_ASSETS = ("raw_images", "bucketed_images", "phashes", "captions", "mds_shards")
SMALL = (300, 200)  # below 384² pixels: kept in raw_images, rejected by the image stage
# Good images per source: "web" spans three chunks of four rows (with its small image and
# its copy) and several aspect-ratio buckets (MDS leaves, so several skip sidecars).
GOOD_IMAGES = {"web": 8, "alt": 5, "more": 4}

# Image-stage settings other than the defaults (every row to redo), in chunks of 4 rows.
NEW_SETTINGS = {"ops": {"image_stage": {"config": {"jpeg_quality": 90, "chunk_rows": 4}}}}
NEW_FINGERPRINT = settings_fingerprint(ImageStageConfig(jpeg_quality=90).options())
RAY_START_TIMEOUT = "The current node timed out during startup"


def _sizes(n: int) -> list[tuple[int, int]]:
    return [(480 + 40 * (i % 8), 360 + 30 * (i % 5)) for i in range(n)]


def write_folder(folder: Path, prefix: str, n: int, seed: int) -> dict[str, str]:
    """n good images with captions, one too small, one exact copy of the first."""
    folder.mkdir(parents=True, exist_ok=True)
    captions = {}
    for i, (w, h) in enumerate(_sizes(n)):
        name = f"{prefix}{i:02d}.jpg"
        (folder / name).write_bytes(jpeg_bytes(w, h, seed + i))
        captions[name] = f"{prefix} photo {i}: coloured shapes, soft light"
        (folder / name).with_suffix(".txt").write_text(captions[name])
    (folder / f"{prefix}small.jpg").write_bytes(jpeg_bytes(*SMALL, seed + 99))
    shutil.copy(folder / f"{prefix}00.jpg", folder / f"{prefix}copy.jpg")
    captions[f"{prefix}copy.jpg"] = captions[f"{prefix}00.jpg"]
    (folder / f"{prefix}copy.txt").write_text(captions[f"{prefix}copy.jpg"])
    return captions


class Corpus:
    """A module's store: sources, data root, Dagster home, and what each source holds."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.data_root = tmp / "data"
        self.home = write_instance_config(tmp / "dagster_home")
        self.folders = {s: tmp / "sources" / s for s in GOOD_IMAGES}
        self.captions = {s: write_folder(self.folders[s], s[0], n, 100 * i)
                         for i, (s, n) in enumerate(GOOD_IMAGES.items())}
        self.sources = write_sources(tmp / "sources.yaml", [
            f"{{name: {s}, kind: image_folder, uri: {f}}}" for s, f in self.folders.items()])
        self.captioner = tmp / "captioner.yaml"
        self.captioner.write_text("backend: original\nchunk_rows: 4\n")
        self.defs = build_defs(self.sources, self.captioner)
        self.instance = open_instance(self.home)

    def files(self, source: str) -> list[str]:
        return sorted(p.name for p in self.folders[source].iterdir() if p.suffix == ".jpg")

    def ids(self, source: str) -> set[str]:
        return {sample_id(source, name) for name in self.files(source)}

    def kept(self, source: str) -> set[str]:
        """Ids the image stage keeps: at least 384² pixels (every aspect here is in range)."""
        kept = set()
        for name in self.files(source):
            with Image.open(self.folders[source] / name) as img:
                if img.width * img.height >= 384 * 384:
                    kept.add(sample_id(source, name))
        return kept

    def uri(self, asset: str, source: str) -> Path:
        return self.data_root / "lance" / asset / f"{source}.lance"

    def spec(self, job: str, partition: str | None, assets=(), captioner: Path | None = None
             ) -> RunSpec:
        return RunSpec(self.sources, job, partition, self.home, self.data_root, tuple(assets),
                       captioner or self.captioner)

    def run(self, job: str, partition: str | None, assets=(), defs=None
            ) -> dg.ExecuteInProcessResult:
        result = run_in_process(defs or self.defs, job, partition, self.instance, assets)
        assert result.success, failure(result)
        return result


@contextmanager
def built_corpus(tmp: Path) -> Iterator[Corpus]:
    """The corpus with "web" through the per-source stages and the global dedup, its data
    root as PRX_DATA_ROOT while it is in use."""
    old = os.environ.get("PRX_DATA_ROOT")
    corpus = Corpus(tmp)
    os.environ["PRX_DATA_ROOT"] = str(corpus.data_root)
    try:
        corpus.run("source_job", "web", STAGE_ASSETS)
        corpus.run("dedup_job", None)
        yield corpus
    finally:
        corpus.instance.dispose()
        if old is None:
            os.environ.pop("PRX_DATA_ROOT", None)
        else:
            os.environ["PRX_DATA_ROOT"] = old


def failure(result: dg.ExecuteInProcessResult) -> str:
    return "\n".join(str(e.step_failure_data.error) for e in result.all_events
                     if e.is_step_failure)


def materialization_meta(result: dg.ExecuteInProcessResult) -> dict:
    """The metadata values of a run's one materialisation."""
    [event] = result.get_asset_materialization_events()
    return {k: v.value for k, v in event.materialization.metadata.items()}


def ids(uri: Path, filter: str | None = None) -> list[str]:
    return lance.dataset(str(uri)).to_table(columns=["id"], filter=filter).column(0).to_pylist()


def assert_exact(found: list[str], expected: set[str]) -> None:
    assert len(found) == len(set(found)), "duplicate ids"
    assert set(found) == expected


def assert_source_complete(corpus: Corpus, source: str, stream: bool = False) -> None:
    """Every table of the source holds exactly the rows its files call for, once; with
    `stream`, every MDS leaf opens with StreamingDataset (a spawned process: seconds)."""
    every, kept = corpus.ids(source), corpus.kept(source)
    assert_exact(ids(corpus.uri("raw_images", source)), every)
    assert_exact(ids(corpus.uri("bucketed_images", source)), every)
    assert_exact(ids(corpus.uri("bucketed_images", source), "status = 'ok'"), kept)
    assert_exact(ids(corpus.uri("phashes", source)), kept)  # rejected before decoding
    # Captions may keep rows of ids no longer kept (they are never read downstream).
    captioned = ids(corpus.uri("captions", source), "caption_version LIKE 'original-%'")
    assert len(captioned) == len(set(captioned)) and set(captioned) >= kept
    assert_exact(ids(corpus.uri("mds_samples", source)), kept)
    if stream:
        assert_tree_streams(corpus, source, len(kept))


def assert_tree_streams(corpus: Corpus, source: str, samples: int) -> None:
    checks, problems = verify_tree(corpus.data_root, source)
    assert checks and all(c.ok for c in checks) and not problems, (checks, problems)
    assert sum(c.streamed for c in checks) == samples


def start_run(corpus: Corpus, spec: RunSpec, tmp: Path, failpoint: str
              ) -> tuple[RunProcess, dict]:
    """Start the run armed with `failpoint` and wait until a process of it holds there;
    returns the run and the failpoint's marker. Ray gives its node a fixed 30 s to start;
    on a heavily loaded machine that can pass, so that one failure is retried once."""
    for attempt in range(2):
        run = RunProcess(spec.arm(failpoint, tmp), tmp)
        try:
            held = wait_for_failpoint(run)
        except AssertionError:
            run.kill()
            if attempt or RAY_START_TIMEOUT not in run.output():
                raise
            mark_killed_run_failed(corpus.instance, spec.run_id)
            spec.run_id = str(uuid.uuid4())
            continue
        assert held["failpoint"] == failpoint
        # The run and its Ray workers import this checkout's code (the marker says whose).
        assert Path(held["module"]).is_relative_to(REPO), held
        return run, held
    raise AssertionError("unreachable")


def kill_mid_stage(corpus: Corpus, spec: RunSpec, step: str, failpoint: str,
                   tmp: Path) -> RunProcess:
    """Start the run, wait until it holds at `failpoint`, SIGKILL the process group; assert
    the step had started and its asset was not materialised."""
    run, _ = start_run(corpus, spec, tmp, failpoint)
    run.kill()
    assert run.process.returncode == -9
    assert step_started(corpus.instance, spec.run_id, step)
    assert not materialized_in_run(corpus.instance, spec.run_id) & set(spec.assets), \
        "the kill came after the stage had finished"
    mark_killed_run_failed(corpus.instance, spec.run_id)
    return run


def image_run(corpus: Corpus, run_config: dict | None = None) -> dict:
    """The image stage on "web" in process; bucketed_images' materialisation metadata."""
    result = run_in_process(corpus.defs, "source_job", "web", corpus.instance,
                            ["bucketed_images", "phashes"], run_config)
    assert result.success, failure(result)
    return next(m.metadata for m in result.asset_materializations_for_node("image_stage")
                if m.asset_key == dg.AssetKey("bucketed_images"))
