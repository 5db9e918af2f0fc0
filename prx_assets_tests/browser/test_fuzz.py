"""Every browser route and query parameter under a seeded fuzzer (Hypothesis): whatever the
value, the answer is a page or a 4xx with a message, never a 5xx or an exception.

The app is called in this process (`testing.asgi`, no server) over the small corpus of
`test_concepts` (corpus, concepts, image embeddings: the Lance filters the routes build).
Found by it: `/concept/1/99999999999` and `/?tier=99999999999` (int32 overflows inside a
Lance filter) answered 500."""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from prx_assets.browser.app import ROUTES, create_app
from prx_assets.browser.facets import ATTRIBUTE_FACETS, QUALITY_FACETS
from prx_assets.storage.layout import Storage
from prx_assets.testing.asgi import get
from prx_assets_tests.browser.test_concepts import (
    IDS,
    _write_concepts,
    _write_corpus,
    _write_image_embeddings,
)

CASES = 100  # per test: a few seconds; the seed is fixed (`derandomize`), so a failure replays
FUZZ = settings(max_examples=CASES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])
PARAMS = ["q", "similar", "source", "label", "tier", "shape", "dup", "skip", "page", "level",
          "concept", "space", "reason", "opted", "next", *ATTRIBUTE_FACETS,
          *(f"{name}_min" for name in QUALITY_FACETS)]
GET_ROUTES = [path for path, _, methods in ROUTES if "GET" in methods]

# Small numbers, the int32 and int64 edges, and beyond (where Lance filters overflowed).
numbers = st.one_of(st.integers(0, 2**16), st.integers(2**31 - 2, 2**31 + 2),
                    st.integers(2**63 - 2, 2**63 + 2), st.integers(2**31, 10**20))
hostile_text = st.one_of(
    st.text(max_size=40),
    numbers.map(str),
    st.integers(min_value=-(10**30), max_value=10**30).map(str),
    st.sampled_from(["", " ", "0", "-1", "1e9", "99999999999", "2147483648", "NaN", "..",
                     "../../etc/passwd", "web:0", IDS[3], "web:' OR 1=1 --", "%00", "\x00",
                     "a" * 3000, "512x512", "99999x99999", "0x0", "level", "image", "ok",
                     "<script>alert(1)</script>", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "\ud7ff", "1/2"]))


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz_corpus")
    store = Storage(root)
    _write_corpus(store)
    _write_concepts(store)
    _write_image_embeddings(store)
    return create_app(root)


def path_segments(route: str, values: list[str], ints: list[int]) -> list[str]:
    """The route's path with its parameters replaced by `values`, as segments; an `int`
    parameter takes the next of `ints` (anything but digits is no such route: a 404)."""
    segments, texts, numbers_left = [], iter(values), iter(ints)
    for part in route.strip("/").split("/"):
        match = re.fullmatch(r"\{(\w+)(?::(\w+))?\}", part)
        if match is None:
            segments.append(part)
        else:
            segments.append(str(next(numbers_left)) if match[2] == "int" else next(texts))
    return segments or [""]


def assert_answered(answer, what: str) -> None:
    """A page, a redirect, or a 4xx error page whose message says something."""
    assert answer.status < 500, f"{what}: {answer.status}"
    if answer.status >= 400:
        assert re.search(r'<p class="error">\s*\S', answer.text), f"{what}: no message"


@FUZZ
@given(route=st.sampled_from(GET_ROUTES),
       values=st.lists(hostile_text, min_size=2, max_size=2),
       ints=st.lists(numbers, min_size=2, max_size=2))
@example(route="/concept/{level:int}/{cluster:int}", values=["", ""],
         ints=[1, 99999999999])  # found by this fuzz: a 500 before
def test_any_path_value_gets_a_page_or_a_4xx(app, route, values, ints):
    segments = path_segments(route, values, ints)
    assert_answered(get(app, segments), f"/{'/'.join(segments)}")


@settings(FUZZ, max_examples=4 * CASES)  # one parameter of the grid: cheap to answer
@given(name=st.sampled_from(PARAMS), value=st.one_of(numbers.map(str), hostile_text))
@example(name="tier", value="99999999999")  # found by this fuzz: a 500 before
def test_any_grid_parameter_gets_a_page_or_a_4xx(app, name, value):
    assert_answered(get(app, [""], {name: value}), f"/?{name}={value!r}")


@FUZZ
@given(route=st.sampled_from(["/", "/rejected", "/duplicates", "/sample/web:1", "/login",
                              "/concept/1/0", "/cards", "/random"]),
       params=st.dictionaries(st.sampled_from(PARAMS), hostile_text, max_size=4))
def test_any_query_parameters_get_a_page_or_a_4xx(app, route, params):
    answer = get(app, route.strip("/").split("/"), params)
    assert_answered(answer, f"{route}?{params}")


def test_the_overflows_it_found_are_4xx_with_a_message(app):
    for segments, params in ((["concept", "1", "99999999999"], {}),
                             ([""], {"tier": "99999999999"})):
        answer = get(app, segments, params)
        assert answer.status == 400, (segments, params)
        assert "must be" in answer.text or "up to" in answer.text
