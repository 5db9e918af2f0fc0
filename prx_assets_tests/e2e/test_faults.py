"""Faults: runs killed in the middle of each stage, a Ray worker killed mid-task, a write
that cannot happen, two partitions at once, and inputs changing between runs.

Everything is real: Dagster runs on an on-disk SQLite instance, embedded Ray, Lance tables,
MDS trees, and SIGKILL of a run's whole process group. A killed run is armed with one of the
stages' failpoints (`prx_assets.storage.failpoints`): the stage holds there, mid-work with
something half-written (ingest between two chunk commits, a batch of the image stage, a
committed caption chunk, a part of a `.partial` MDS tree, one replaced skip sidecar), and
the test kills it once the marker file says so. No kill waits for a sleep or races the run.

One small corpus is built once for the module (in process, on the session's Ray); runs armed
with a failpoint and the concurrent partitions go through subprocesses (each with its own
embedded Ray, which inherits the failpoint variables). Tests leave the store consistent
for the next one.
"""

from __future__ import annotations

import os
import shutil
import signal
import uuid
from pathlib import Path

import dagster as dg
import lance
import pytest
from PIL import Image

from prx_assets.definitions import build_defs
from prx_assets.defs.images import ImageStageConfig
from prx_assets.stages.images.stage import settings_fingerprint
from prx_assets.stages.ingest.ids import sample_id
from prx_assets.stages.shards.verify import verify_tree
from prx_assets.stages.skip_lists.skip_lists import skipped_ids
from prx_assets.storage.layout import Storage
from prx_assets.storage.sidecars import read_sidecar, sidecar_files
from prx_assets.storage.tables import MDS_SAMPLES
from prx_assets.storage.trees import PARTIAL_SUFFIX, TREES_DIR, current_tree
from prx_assets.testing.fault_runs import (
    CaptionServer,
    RunProcess,
    RunSpec,
    mark_killed_run_failed,
    materialized_in_run,
    open_instance,
    process_title,
    run_in_process,
    step_started,
    store_state,
    table_state,
    wait_for_failpoint,
    write_instance_config,
)
from prx_assets.testing.images import jpeg_bytes
from prx_assets.testing.sources import write_sources

pytestmark = pytest.mark.e2e  # whole-graph runs and runs in subprocesses

REPO = Path(__file__).resolve().parents[2]
STAGE_ASSETS = ("raw_images", "bucketed_images", "phashes", "captions", "mds_shards")
SMALL = (300, 200)  # below 384² pixels: kept in raw_images, rejected by the image stage


# Image-stage settings other than the defaults (every row to redo), in chunks of 4 rows.
NEW_SETTINGS = {"ops": {"image_stage": {"config": {"jpeg_quality": 90, "chunk_rows": 4}}}}
NEW_FINGERPRINT = settings_fingerprint(ImageStageConfig(jpeg_quality=90).options())


def _sizes(n: int) -> list[tuple[int, int]]:
    return [(480 + 40 * (i % 8), 360 + 30 * (i % 5)) for i in range(n)]


def _write_folder(folder: Path, prefix: str, n: int, seed: int) -> dict[str, str]:
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
    """The module's store: sources, data root, Dagster home, and what each source holds."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.data_root = tmp / "data"
        self.home = write_instance_config(tmp / "dagster_home")
        self.folders = {s: tmp / "sources" / s for s in ("web", "alt", "more")}
        self.captions = {"web": _write_folder(self.folders["web"], "w", 14, 0),
                         "alt": _write_folder(self.folders["alt"], "a", 5, 100),
                         "more": _write_folder(self.folders["more"], "m", 5, 200)}
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
        assert result.success, _failure(result)
        return result


def _failure(result: dg.ExecuteInProcessResult) -> str:
    return "\n".join(e.event_specific_data.error.to_string() for e in result.all_events
                     if e.event_type_value == "STEP_FAILURE")


@pytest.fixture(scope="module")
def corpus(ray_session, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
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


def _ids(uri: Path, filter: str | None = None) -> list[str]:
    return lance.dataset(str(uri)).to_table(columns=["id"], filter=filter).column(0).to_pylist()


def _assert_exact(ids: list[str], expected: set[str]) -> None:
    assert len(ids) == len(set(ids)), "duplicate ids"
    assert set(ids) == expected


def _assert_source_complete(corpus: Corpus, source: str, stream: bool = False) -> None:
    """Every table of the source holds exactly the rows its files call for, once; with
    `stream`, every MDS leaf opens with StreamingDataset (a spawned process: seconds)."""
    ids, kept = corpus.ids(source), corpus.kept(source)
    _assert_exact(_ids(corpus.uri("raw_images", source)), ids)
    _assert_exact(_ids(corpus.uri("bucketed_images", source)), ids)
    _assert_exact(_ids(corpus.uri("bucketed_images", source), "status = 'ok'"), kept)
    _assert_exact(_ids(corpus.uri("phashes", source)), kept)  # rejected before decoding
    # Captions may keep rows of ids no longer kept (they are never read downstream).
    captioned = _ids(corpus.uri("captions", source), "caption_version LIKE 'original-%'")
    assert len(captioned) == len(set(captioned)) and set(captioned) >= kept
    _assert_exact(_ids(corpus.uri("mds_samples", source)), kept)
    if stream:
        _assert_tree_streams(corpus, source, len(kept))


def _assert_tree_streams(corpus: Corpus, source: str, samples: int) -> None:
    checks, problems = verify_tree(corpus.data_root, source)
    assert checks and all(c.ok for c in checks) and not problems, (checks, problems)
    assert sum(c.streamed for c in checks) == samples


RAY_START_TIMEOUT = "The current node timed out during startup"


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


def _kill_mid_stage(corpus: Corpus, spec: RunSpec, step: str, failpoint: str,
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


# ------------------------------------------------------------------------ killed mid-stage

def _without(rows: list[dict], column: str) -> list[dict]:
    return sorted(({k: v for k, v in r.items() if k != column} for r in rows),
                  key=lambda r: r["id"])


def test_kill_during_ingest(corpus, tmp_path):
    """Every file of the source touched (same bytes, a later mtime), so the run reads them
    all again; killed right after its first chunk commit, it leaves a readable table with
    every id once, and the rerun reads only the units not committed."""
    before = store_state(corpus.data_root, ["web"])
    files = sorted(corpus.folders["web"].glob("*.jpg"))
    for path in files:
        stat = path.stat()
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    config = {"ops": {"raw_images": {"config": {"chunk_rows": 4, "files_per_task": 4}}}}
    spec = corpus.spec("source_job", "web", ["raw_images"])
    spec.run_config = config
    _kill_mid_stage(corpus, spec, "raw_images", "ingest.chunk_committed", tmp_path)
    killed = table_state(corpus.uri("raw_images", "web"))
    _assert_exact(_ids(corpus.uri("raw_images", "web")), corpus.ids("web"))
    assert _without(killed["rows"], "unit_signature") == \
        _without(before["raw_images/web"]["rows"], "unit_signature")  # same content
    others = {k: v for k, v in store_state(corpus.data_root, ["web"]).items()
              if k != "raw_images/web"}
    assert others == {k: v for k, v in before.items() if k != "raw_images/web"}

    result = run_in_process(corpus.defs, "source_job", "web", corpus.instance, ["raw_images"],
                            run_config=config)
    assert result.success, _failure(result)
    [event] = result.get_asset_materialization_events()
    meta = {k: v.value for k, v in event.event_specific_data.materialization.metadata.items()}
    assert 0 < meta["rows_processed"] < len(files)  # only what the killed run had not committed
    assert meta["rows_processed"] + meta["rows_reused"] == len(files)
    _assert_exact(_ids(corpus.uri("raw_images", "web")), corpus.ids("web"))
    after = table_state(corpus.uri("raw_images", "web"))
    assert after["version"] > before["raw_images/web"]["version"]
    assert _without(after["rows"], "unit_signature") == \
        _without(before["raw_images/web"]["rows"], "unit_signature")  # same inputs, same rows


def test_kill_during_image_stage(corpus, tmp_path):
    """A settings change (every row to redo) committed four rows at a time, killed right
    after its first chunk: the chunk is kept, the rerun does only the rest and equals a
    full run under those settings; a full redo under the old settings gives back the old
    bytes."""
    assets = ["bucketed_images", "phashes"]
    before = store_state(corpus.data_root, ["web"])
    bucketed = corpus.uri("bucketed_images", "web")
    spec = corpus.spec("source_job", "web", assets)
    spec.run_config = NEW_SETTINGS
    _kill_mid_stage(corpus, spec, "image_stage", "images.chunk_committed", tmp_path)
    outage = table_state(bucketed)
    assert outage["version"] > before["bucketed_images/web"]["version"]
    _assert_exact([r["id"] for r in outage["rows"]], corpus.ids("web"))  # none lost, none doubled
    redone = [r["id"] for r in outage["rows"] if r["settings"] == NEW_FINGERPRINT]
    assert len(redone) == 4, "not killed after exactly one chunk"

    meta = _image_run(corpus, NEW_SETTINGS)
    assert (meta["rows_processed"].value, meta["rows_reused"].value) == \
        (len(corpus.ids("web")) - 4, 4)
    resumed = store_state(corpus.data_root, ["web"])
    assert {r["settings"] for r in resumed["bucketed_images/web"]["rows"]} == {NEW_FINGERPRINT}
    _assert_source_complete(corpus, "web")

    assert _image_run(corpus)["rows_processed"].value == len(corpus.ids("web"))
    for name in assets:  # the old settings again: the old bytes
        assert table_state(corpus.uri(name, "web"))["rows"] == before[f"{name}/web"]["rows"]
    _image_run(corpus, NEW_SETTINGS)  # a full run under the new settings: what resuming made
    for name in assets:
        assert table_state(corpus.uri(name, "web"))["rows"] == resumed[f"{name}/web"]["rows"]
    _image_run(corpus)  # leave the store as the other tests expect it


def _image_run(corpus: Corpus, run_config: dict | None = None) -> dict:
    """The image stage on "web" in process; bucketed_images' materialisation metadata."""
    result = run_in_process(corpus.defs, "source_job", "web", corpus.instance,
                            ["bucketed_images", "phashes"], run_config)
    assert result.success, _failure(result)
    return next(m.metadata for m in result.asset_materializations_for_node("image_stage")
                if m.asset_key == dg.AssetKey("bucketed_images"))


def test_kill_during_captions(corpus, tmp_path):
    """A new caption version through a (local) OpenAI-compatible endpoint, committed two
    rows at a time: killed right after its first chunk commit, the rerun finishes the rest."""
    server = CaptionServer()
    captioner = tmp_path / "captioner.yaml"
    captioner.write_text(f"backend: openai\nmodel: test-vlm\nendpoint: {server.url}\n"
                         "chunk_rows: 2\nbatch_size: 2\nrequest_concurrency: 1\n")
    captions_uri = corpus.uri("captions", "web")
    try:
        before = store_state(corpus.data_root, ["web"])
        start_version = before["captions/web"]["version"]
        spec = corpus.spec("captions_job", "web", ["captions"], captioner=captioner)
        _kill_mid_stage(corpus, spec, "captions", "captions.chunk_committed", tmp_path)
        assert lance.dataset(str(captions_uri)).version > start_version
        # Everything but captions is untouched; captions' previous version reads as before,
        # and its latest holds the old rows plus whole committed chunks of the new version.
        outage = store_state(corpus.data_root, ["web"])
        assert {k: v for k, v in outage.items() if k != "captions/web"} == \
            {k: v for k, v in before.items() if k != "captions/web"}
        assert table_state(captions_uri, start_version) == before["captions/web"]
        defs = build_defs(corpus.sources, captioner)
        version = defs.resources["captioner"].produced_version()
        partial = _ids(captions_uri, f"caption_version = '{version}'")
        assert 0 < len(partial) < len(corpus.kept("web")), "not killed mid-stage"
        assert len(partial) % 2 == 0 and set(partial) <= corpus.kept("web")
        assert len(set(partial)) == len(partial)

        result = corpus.run("captions_job", "web", defs=defs)
        meta = result.asset_materializations_for_node("captions")[0].metadata
        assert meta["captioned_this_run"].value == len(corpus.kept("web")) - len(partial)
        _assert_exact(_ids(captions_uri, f"caption_version = '{version}' AND status = 'ok'"),
                      corpus.kept("web"))
        old = [r for r in table_state(captions_uri)["rows"] if r["caption_version"] != version]
        assert old == before["captions/web"]["rows"]  # the other version's rows untouched
    finally:
        server.close()


def test_kill_during_mds_shards(corpus, tmp_path):
    before = store_state(corpus.data_root, ["web"])
    trees = corpus.data_root / "mds" / TREES_DIR / "web"
    spec = corpus.spec("source_job", "web", ["mds_shards"])
    # Nothing changed since the tree was built, so only a full build has work to kill.
    spec.run_config = {"ops": {"mds_shards": {"config": {"incremental": False}}}}
    _kill_mid_stage(corpus, spec, "mds_shards", "mds.write_part", tmp_path)
    assert list(trees.glob("*" + PARTIAL_SUFFIX)), "the killed build left its staging"
    # The symlinked tree still resolves to the same whole tree: index.json, shard bytes,
    # sidecars and what StreamingDataset counts, as well as every table, are unchanged.
    assert store_state(corpus.data_root, ["web"]) == before
    _assert_tree_streams(corpus, "web", len(corpus.kept("web")))

    # The (incremental) rerun clears the leftovers and finds the current tree up to date.
    corpus.run("source_job", "web", ["mds_shards"])
    assert not list(trees.glob("*" + PARTIAL_SUFFIX))
    assert current_tree(corpus.data_root, "web").name == before["mds/web"]["tree"]
    _assert_source_complete(corpus, "web", stream=True)


def test_kill_during_skip_lists(corpus, tmp_path):
    corpus.run("skip_lists_job", "web", ["skip_lists"])  # the current tree has its sidecars
    tree = current_tree(corpus.data_root, "web")
    old_sidecars = {p: read_sidecar(p) for p in sidecar_files(tree)}
    assert old_sidecars  # the copy is a duplicate: a dedup list exists
    # A new ablation list changes what the rerun must write.
    ablated = sorted(corpus.kept("web"))[:3]
    ablations = corpus.data_root / "ablations"
    ablations.mkdir(exist_ok=True)
    (ablations / "faults.txt").write_text("\n".join(ablated) + "\n")
    before = store_state(corpus.data_root, ["web"])
    mapping = Storage(corpus.data_root).table(MDS_SAMPLES, "web")
    dedup = set(skipped_ids(tree, mapping, ["dedup"]).to_pylist())
    assert dedup == {sample_id("web", "wcopy.jpg")} or dedup == {sample_id("web", "w00.jpg")}
    try:
        spec = corpus.spec("skip_lists_job", "web", ["skip_lists"])
        _kill_mid_stage(corpus, spec, "skip_lists", "skip_lists.sidecar_written", tmp_path)
        outage = store_state(corpus.data_root, ["web"])
        tables = {k: v for k, v in before.items() if not k.startswith("mds/")}
        assert {k: v for k, v in outage.items() if not k.startswith("mds/")} == tables
        # Each sidecar (parsed by store_state) holds the old lists or the new, never a mix.
        for leaf, shards in outage["mds/web"]["leaves"].items():
            for name, shard in shards.items():
                old = before["mds/web"]["leaves"][leaf][name]
                assert {k: v for k, v in shard.items() if k != "skip"} == \
                    {k: v for k, v in old.items() if k != "skip"}
                assert shard["skip"] == old["skip"] or "faults" in shard["skip"]

        result = corpus.run("skip_lists_job", "web", ["skip_lists"])
        meta = result.asset_materializations_for_node("skip_lists")[0].metadata
        assert meta["skipped_per_reason"].value.records
        assert set(skipped_ids(tree, mapping, ["faults"]).to_pylist()) == set(ablated)
        assert set(skipped_ids(tree, mapping, ["dedup"]).to_pylist()) == dedup
    finally:
        shutil.rmtree(ablations)
        corpus.run("skip_lists_job", "web", ["skip_lists"])


# ------------------------------------------------------------------------ a Ray worker dies

LABELS_IN_FOURS = {"ops": {"caption_labels": {"config": {"chunk_rows": 4}}}}


def _labelled(corpus: Corpus, source: str) -> list[str]:
    return _ids(corpus.uri("caption_labels", source))


def test_kill_during_labels(corpus, tmp_path):
    """Labels committed four at a time, killed right after the first chunk's commit: the
    chunk is kept (each id once), the rerun labels only the rest."""
    if corpus.uri("caption_labels", "web").exists():
        shutil.rmtree(corpus.uri("caption_labels", "web"))  # every caption pending
    spec = corpus.spec("source_job", "web", ["caption_labels"])
    spec.run_config = LABELS_IN_FOURS
    _kill_mid_stage(corpus, spec, "caption_labels", "labels.chunk_committed", tmp_path)
    killed = _labelled(corpus, "web")
    assert len(killed) == 4 and len(set(killed)) == 4

    result = run_in_process(corpus.defs, "source_job", "web", corpus.instance,
                            ["caption_labels"], run_config=LABELS_IN_FOURS)
    assert result.success, _failure(result)
    [event] = result.get_asset_materialization_events()
    meta = {k: v.value for k, v in event.event_specific_data.materialization.metadata.items()}
    _assert_exact(_labelled(corpus, "web"), corpus.kept("web"))
    assert meta["rows_processed"] == len(corpus.kept("web")) - 4


ATTRIBUTES_IN_FOURS = {"resources": {"attributer": {"config": {"chunk_rows": 4}}}}


def test_kill_during_attributes(corpus, tmp_path):
    """Attributes committed four at a time, killed right after the first chunk's commit:
    the chunk is kept (each id once) and no record of the captions is written (the run did
    not finish them); the rerun tags only the rest, then records."""
    table = corpus.uri("attributes", "web")
    if table.exists():
        shutil.rmtree(table)  # every caption pending
    spec = corpus.spec("source_job", "web", ["attributes"])
    spec.run_config = ATTRIBUTES_IN_FOURS
    _kill_mid_stage(corpus, spec, "attributes", "attributes.chunk_committed", tmp_path)
    killed = _ids(table)
    assert len(killed) == 4 and len(set(killed)) == 4
    assert not [k for k in lance.dataset(str(table)).config() if k.startswith("prx.consumed")]

    result = run_in_process(corpus.defs, "source_job", "web", corpus.instance,
                            ["attributes"], run_config=ATTRIBUTES_IN_FOURS)
    assert result.success, _failure(result)
    [event] = result.get_asset_materialization_events()
    meta = {k: v.value for k, v in event.event_specific_data.materialization.metadata.items()}
    _assert_exact(_ids(table), corpus.kept("web"))
    assert meta["rows_processed"] == len(corpus.kept("web")) - 4
    assert [k for k in lance.dataset(str(table)).config() if k.startswith("prx.consumed")]


def _corpus_rows(corpus: Corpus) -> tuple[int, list[tuple[str, str]]]:
    table = lance.dataset(str(corpus.data_root / "lance" / "corpus.lance"))
    rows = table.to_table(columns=["id", "source"])
    return table.version, sorted(zip(rows["id"].to_pylist(), rows["source"].to_pylist(),
                                     strict=True))


def test_kill_during_corpus_replace(corpus, tmp_path):
    """A source joining the corpus, killed with its rows written but before its one commit:
    the corpus is exactly as before (no source half in, none doubled); the rerun adds the
    source's rows, each once, and keeps the others."""
    if not corpus.uri("caption_labels", "web").exists():
        corpus.run("source_job", "web", ["caption_labels"])
    corpus.run("corpus_table_job", None)  # "more" has no labels yet: left out
    before_version, before = _corpus_rows(corpus)
    assert before and {source for _, source in before} == {"web"}
    corpus.run("source_job", "more", ["raw_images", "bucketed_images", "phashes", "captions",
                                      "caption_labels"])

    spec = corpus.spec("corpus_table_job", None, ["corpus"])
    _kill_mid_stage(corpus, spec, "corpus", "storage.replace_uncommitted", tmp_path)
    assert _corpus_rows(corpus) == (before_version, before)

    corpus.run("corpus_table_job", None)
    _, after = _corpus_rows(corpus)
    ids = [i for i, _ in after]
    assert len(ids) == len(set(ids)), "duplicate ids"
    assert [r for r in after if r[1] == "web"] == before
    more = {i for i, source in after if source == "more"}
    assert more and more <= corpus.kept("more")


def test_kill_during_dedup_and_opt_outs(corpus, tmp_path):
    """dedup_job (the global duplicates and the opt-out audit, each one whole-table write)
    killed with a table's fragments written but not committed: both tables keep the version
    and rows they had; the rerun commits both, the duplicates equal to before (same
    inputs)."""
    tables = {name: corpus.data_root / "lance" / f"{name}.lance"
              for name in ("duplicates", "opt_outs")}
    # Committed over the module's current inputs first: earlier tests may have added a
    # source since the module's own dedup_job.
    corpus.run("dedup_job", None)
    before = {"duplicates": table_state(tables["duplicates"])}
    spec = corpus.spec("dedup_job", None, ["duplicates", "opt_outs"])
    run, _ = start_run(corpus, spec, tmp_path, "storage.overwrite_uncommitted")
    run.kill()
    assert run.process.returncode == -9
    mark_killed_run_failed(corpus.instance, spec.run_id)
    # The asset held had not committed; the other may have, with the same rows (same inputs).
    assert table_state(tables["duplicates"])["rows"] == before["duplicates"]["rows"]
    if tables["opt_outs"].exists():
        table_state(tables["opt_outs"])  # readable

    corpus.run("dedup_job", None)
    assert table_state(tables["duplicates"])["rows"] == before["duplicates"]["rows"]
    assert tables["opt_outs"].exists()


def test_ray_worker_killed_mid_task(corpus, tmp_path):
    """SIGKILL the Ray worker held inside the image stage's task: Ray Data retries the task,
    the retry passes the failpoint (it fires once per run), and the run commits exactly the
    expected rows. (New settings, so that every row has to be redone.)"""
    spec = corpus.spec("source_job", "web", ["bucketed_images", "phashes"])
    spec.run_config = NEW_SETTINGS
    run, held = start_run(corpus, spec, tmp_path, "images.bucket_batch")
    killed: list[str] = []
    try:
        title = process_title(held["pid"])
        assert held["pid"] != run.process.pid and title.startswith("ray::"), title
        os.kill(held["pid"], signal.SIGKILL)
        killed.append(title)
        result = run.wait(timeout=600)
    finally:
        if run.alive():
            run.kill()
    assert result["success"], run.output()[-6000:]
    assert killed and "bucket_batch" in killed[0], "no worker was caught mid-task"
    _assert_source_complete(corpus, "web")
    rows = table_state(corpus.uri("bucketed_images", "web"))["rows"]
    assert {r["settings"] for r in rows} == {NEW_FINGERPRINT}
    _image_run(corpus)  # back to the default settings


# ------------------------------------------------------------------------ a write that fails

def test_unwritable_output_fails_clearly(corpus):
    """A regular file where a folder must be created: the partition fails with a message
    naming the path and the cause; nothing stored before is touched."""
    before = store_state(corpus.data_root, ["web"])
    blocker = corpus.data_root / "lance" / "bucketed_images" / "alt.lance"
    corpus.run("source_job", "alt", ["raw_images"])
    raw_alt = table_state(corpus.uri("raw_images", "alt"))
    blocker.write_text("not a table")
    try:
        result = run_in_process(corpus.defs, "source_job", "alt", corpus.instance,
                                ["bucketed_images", "phashes"])
        assert not result.success
        message = _failure(result)
        assert str(blocker) in message and "not a folder" in message, message
        assert store_state(corpus.data_root, ["web"]) == before
        assert table_state(corpus.uri("raw_images", "alt")) == raw_alt
        assert blocker.read_text() == "not a table"
    finally:
        blocker.unlink()


# ------------------------------------------------------------------------ concurrent partitions

def test_two_partitions_at_once(corpus, tmp_path):
    """Two runs, two sources, two processes with their own embedded Ray, one instance."""
    before = store_state(corpus.data_root, ["web"])
    runs = [RunProcess(corpus.spec("source_job", source, STAGE_ASSETS), tmp_path)
            for source in ("alt", "more")]
    results = [run.wait(timeout=600) for run in runs]
    for i, (run, result) in enumerate(zip(runs, results, strict=True)):
        if not result["success"] and RAY_START_TIMEOUT in run.output():  # see start_run
            runs[i] = RunProcess(corpus.spec("source_job", run.spec.partition, STAGE_ASSETS),
                                 tmp_path)
            result = results[i] = runs[i].wait(timeout=600)
        assert result["success"], runs[i].output()[-6000:]
    for source in ("alt", "more"):
        _assert_source_complete(corpus, source)
        assert materialized_in_run(corpus.instance, runs[0 if source == "alt" else 1]
                                   .spec.run_id) >= {"raw_images", "mds_shards"}
    assert store_state(corpus.data_root, ["web"]) == before


# ------------------------------------------------------------------------ inputs changing

def test_inputs_changing_between_runs(corpus):
    """Files added, removed and modified in a folder source: the rerun reflects exactly the
    new state in every table, the captions downstream sees and the MDS tree."""
    source, folder = "alt", corpus.folders["alt"]
    if not corpus.uri("mds_samples", source).exists():
        corpus.run("source_job", source, STAGE_ASSETS)
    old_raw = {r["source_key"]: r for r in table_state(corpus.uri("raw_images", source))["rows"]}
    # added
    (folder / "a_new.jpg").write_bytes(jpeg_bytes(720, 540, 555))
    (folder / "a_new.txt").write_text("a new photo")
    # removed (with its caption)
    (folder / "a01.jpg").unlink()
    (folder / "a01.txt").unlink()
    # modified: new pixels and size, new caption; and the small one grows past the filter
    (folder / "a02.jpg").write_bytes(jpeg_bytes(900, 600, 777))
    (folder / "a02.txt").write_text("a02 replaced by a wide photo")
    (folder / "asmall.jpg").write_bytes(jpeg_bytes(640, 480, 778))
    (folder / "asmall.txt").write_text("the small one, now big enough")

    corpus.run("source_job", source, STAGE_ASSETS)
    _assert_source_complete(corpus, source)  # exact id sets, from the files now present
    raw = {r["source_key"]: r for r in table_state(corpus.uri("raw_images", source))["rows"]}
    assert set(raw) == set(corpus.files(source))
    assert raw["a02.jpg"]["width"] == 900 and raw["a02.jpg"]["image"] != old_raw["a02.jpg"]["image"]
    assert raw["a03.jpg"] == old_raw["a03.jpg"]  # unchanged file, unchanged row
    # What the trainer reads: one sample per current file, with its current caption. The
    # rerun appended the new and changed files as new shards; their old copies and the
    # removed file stay in older shards, skipped as `stale` (applied whatever the reasons).
    from streaming import Stream

    from prx_assets.engine.shm_prefix import claiming_prefix
    from prx_assets.loader.dataset import SkipListStreamingDataset

    tree = current_tree(corpus.data_root, source)
    streams = [Stream(local=str(p.parent)) for p in sorted(tree.glob("*/*/index.json"))]
    dataset = claiming_prefix(lambda: SkipListStreamingDataset(
        streams=streams, batch_size=1, skip_reasons=(), shuffle=False, decode_images=False))
    samples = {sample["id"]: sample for sample in dataset}
    assert sample_id(source, "asmall.jpg") in corpus.kept(source)
    assert set(samples) == corpus.kept(source)
    for name in corpus.files(source):
        caption = (folder / name).with_suffix(".txt").read_text().strip()
        assert samples[sample_id(source, name)]["caption"] == caption, name
    assert samples[sample_id(source, "a02.jpg")]["original_width"] == 900
