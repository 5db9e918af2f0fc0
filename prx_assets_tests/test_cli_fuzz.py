"""The CLI's arguments under a seeded fuzzer (Hypothesis): any value gets an answer (exit
status 0, or 1/2 with a message on stderr), never a traceback.

Over the small corpus of the browser's `test_concepts` (with its full-text index, so the
search's filters run). Found by it: `mds-uri` took any name (`../../etc`) into the trees'
and the reader leases' paths, `--lease -1` or `nan` hours, and `search`/`similar --k 0` or
`-1` (a ValueError from Lance)."""

from __future__ import annotations

import contextlib
import io

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from prx_assets import cli
from prx_assets.stages.corpus.corpus import create_indexes
from prx_assets.storage.layout import Storage
from prx_assets.storage.tables import CORPUS
from prx_assets_tests.browser.test_concepts import IDS, _write_corpus

CASES = 150
FUZZ = settings(max_examples=CASES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])

hostile = st.one_of(
    st.text(max_size=30).filter(lambda t: "\x00" not in t),  # argv cannot hold a NUL
    st.integers(-(10**20), 10**20).map(str),
    st.sampled_from(["", "-1", "0", "nan", "inf", "1e400", "99999999999", "../../etc",
                     "web", "web:0", IDS[2], "a'b", "id > 3", "caption = 'x' OR 1=1",
                     "--help", "-", "subset", "visual", "𝔘"]))


def _commands(value: str, other: str) -> st.SearchStrategy[list[str]]:
    return st.sampled_from([
        ["search", value], ["search", "caption", "--k", value],
        ["search", "caption", "--where", value], ["search", "caption", "--source", value],
        ["search", "caption", "--label", value], ["similar", value],
        ["similar", IDS[0], "--k", value], ["similar", IDS[0], "--where", value],
        ["mds-uri", value], ["mds-uri", "--subset", value], ["mds-uri", "web", "--lease", value],
        ["mds-uri", value, "--lease", other], ["opt-out", value, "--reason", other],
        ["opt-out", IDS[1], "--reason", value], [value], [value, other]])


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_fuzz")
    store = Storage(root)
    _write_corpus(store)
    create_indexes(store.table(CORPUS), ["caption"])
    return root


def run(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            status = cli.main(argv)
        except SystemExit as exit_:  # argparse: a usage error (2) or --help (0)
            status = exit_.code if isinstance(exit_.code, int) else 2
    return status, err.getvalue()


@FUZZ
@given(argv=st.tuples(hostile, hostile).flatmap(lambda pair: _commands(*pair)))
@example(argv=["mds-uri", "../../etc", "--lease", "2"])  # found by this fuzz
@example(argv=["mds-uri", "web", "--lease", "nan"])
@example(argv=["search", "caption", "--k", "-1"])
@example(argv=["similar", IDS[0], "--k", "0"])
def test_any_argument_gets_an_answer_not_a_traceback(data_root, monkeypatch, argv):
    monkeypatch.setenv("PRX_DATA_ROOT", str(data_root))
    status, err = run(argv)
    assert status in (0, 1, 2), (argv, status)
    if status:
        assert err.strip(), (argv, "no message")
    assert not (data_root.parent / "etc").exists()  # nothing written outside the root
