"""Faults in the text stages: runs of captions, labels and attributes killed right after
their first committed chunk.

How every fault test here runs: the package docstring (faults/__init__.py).
"""

from __future__ import annotations

import shutil

import lance
import pytest

from prx_assets.definitions import build_defs
from prx_assets.testing.fault_corpus import (
    Corpus,
    assert_exact,
    failure,
    ids,
    kill_mid_stage,
    materialization_meta,
)
from prx_assets.testing.fault_runs import (
    CaptionServer,
    run_in_process,
    store_state,
    table_state,
)

pytestmark = pytest.mark.e2e  # whole-graph runs and runs in subprocesses


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
        kill_mid_stage(corpus, spec, "captions", "captions.chunk_committed", tmp_path)
        assert lance.dataset(str(captions_uri)).version > start_version
        # Everything but captions is untouched; captions' previous version reads as before,
        # and its latest holds the old rows plus whole committed chunks of the new version.
        outage = store_state(corpus.data_root, ["web"])
        assert {k: v for k, v in outage.items() if k != "captions/web"} == \
            {k: v for k, v in before.items() if k != "captions/web"}
        assert table_state(captions_uri, start_version) == before["captions/web"]
        defs = build_defs(corpus.sources, captioner)
        version = defs.resources["captioner"].produced_version()
        partial = ids(captions_uri, f"caption_version = '{version}'")
        assert 0 < len(partial) < len(corpus.kept("web")), "not killed mid-stage"
        assert len(partial) % 2 == 0 and set(partial) <= corpus.kept("web")
        assert len(set(partial)) == len(partial)

        result = corpus.run("captions_job", "web", defs=defs)
        meta = result.asset_materializations_for_node("captions")[0].metadata
        assert meta["captioned_this_run"].value == len(corpus.kept("web")) - len(partial)
        assert_exact(ids(captions_uri, f"caption_version = '{version}' AND status = 'ok'"),
                      corpus.kept("web"))
        old = [r for r in table_state(captions_uri)["rows"] if r["caption_version"] != version]
        assert old == before["captions/web"]["rows"]  # the other version's rows untouched
    finally:
        server.close()


LABELS_IN_FOURS = {"ops": {"caption_labels": {"config": {"chunk_rows": 4}}}}


def _labelled(corpus: Corpus, source: str) -> list[str]:
    return ids(corpus.uri("caption_labels", source))


def test_kill_during_labels(corpus, tmp_path):
    """Labels committed four at a time, killed right after the first chunk's commit: the
    chunk is kept (each id once), the rerun labels only the rest."""
    if corpus.uri("caption_labels", "web").exists():
        shutil.rmtree(corpus.uri("caption_labels", "web"))  # every caption pending
    spec = corpus.spec("source_job", "web", ["caption_labels"])
    spec.run_config = LABELS_IN_FOURS
    kill_mid_stage(corpus, spec, "caption_labels", "labels.chunk_committed", tmp_path)
    killed = _labelled(corpus, "web")
    assert len(killed) == 4 and len(set(killed)) == 4

    result = run_in_process(corpus.defs, "source_job", "web", corpus.instance,
                            ["caption_labels"], run_config=LABELS_IN_FOURS)
    assert result.success, failure(result)
    meta = materialization_meta(result)
    assert_exact(_labelled(corpus, "web"), corpus.kept("web"))
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
    kill_mid_stage(corpus, spec, "attributes", "attributes.chunk_committed", tmp_path)
    killed = ids(table)
    assert len(killed) == 4 and len(set(killed)) == 4
    assert not [k for k in lance.dataset(str(table)).config() if k.startswith("prx.consumed")]

    result = run_in_process(corpus.defs, "source_job", "web", corpus.instance,
                            ["attributes"], run_config=ATTRIBUTES_IN_FOURS)
    assert result.success, failure(result)
    meta = materialization_meta(result)
    assert_exact(ids(table), corpus.kept("web"))
    assert meta["rows_processed"] == len(corpus.kept("web")) - 4
    assert [k for k in lance.dataset(str(table)).config() if k.startswith("prx.consumed")]
