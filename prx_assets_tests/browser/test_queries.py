"""The browser's pure parts, without a browser: query parsing and the facets' filters,
the opt-out request writer and the metadata links. (Near-duplicate pairs and clusters are
the dedup stage's: `prx_assets_tests/stages/dedup/test_near.py`.)"""

from __future__ import annotations

import json
from datetime import UTC, datetime

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from prx_assets.browser import catalog, facets, links
from prx_assets.browser.auth import RateLimit
from prx_assets.stages.opt_outs.requests import files_requesting, parse_directory, write_request
from prx_assets.storage import filters


def test_query_parse_validates_every_parameter():
    query = facets.Query.parse({"q": "  a cat ", "source": "web", "label": "text",
                                "tier": "1024", "shape": "512x512", "dup": "kept",
                                "skip": "optout", "page": "2"})
    assert (query.text, query.tier, query.page) == ("a cat", 1024, 2)
    assert query.params(source="") == {"q": "a cat", "label": "text", "tier": "1024",
                                       "shape": "512x512", "dup": "kept", "skip": "optout"}
    where = facets.corpus_filter(facets.Query(source="web", tier=512, shape="64x32"), None)
    assert where.equals((pc.field("source") == "web") & (pc.field("tier") == 512)
                        & ((pc.field("width") == 64) & (pc.field("height") == 32)))
    for bad in ({"source": "a'b"}, {"label": "cat"}, {"tier": "1 OR 1"}, {"shape": "1x1'"},
                {"dup": "maybe"}, {"skip": "x y"}, {"page": "-1"}, {"page": "1e9"}):
        with pytest.raises(catalog.BadQuery):
            facets.Query.parse(bad)
    with pytest.raises(catalog.NotFound):
        facets.Query.parse({"similar": "../../etc/passwd"})


def test_id_set_facets_filter_by_arrow_expressions(tmp_path):
    """`dup` and `skip` select rows by an id set (an Arrow `isin` as the scanner's filter,
    no SQL of quoted ids): alone, with a column facet, in a count, in a full-text search."""
    import lance
    import pyarrow as pa

    ids = [f"{'web' if n % 2 else 'stock'}:{n:03d}" for n in range(200)]
    table = lance.write_dataset(pa.table({
        "id": ids, "source": [i.split(":")[0] for i in ids],
        "caption": ["a red cat" if n % 3 == 0 else "a blue dog" for n in range(200)]}),
        str(tmp_path / "corpus.lance"))
    table.create_scalar_index("caption", index_type="INVERTED")
    duplicate, kept = set(ids[:30]), set(ids[30:40])
    optout, dedup = {ids[5], ids[50], "web:gone"}, set(ids[100:110])
    sets = {"dup": {"duplicate": facets.IdSet.of(duplicate), "kept": facets.IdSet.of(kept)},
            "skip": {"dedup": facets.IdSet.of(dedup), "optout": facets.IdSet.of(optout)}}

    def matching(**scan) -> set[str]:
        where = facets.corpus_filter(facets.Query(**scan.pop("query")), sets)
        return set(table.to_table(columns=["id"], filter=where, **scan).column("id").to_pylist())

    assert matching(query={"dup": "duplicate"}) == duplicate
    assert matching(query={"dup": "unique"}) == set(ids) - duplicate - kept
    assert matching(query={"dup": "kept", "source": "web"}) == {
        i for i in kept if i.startswith("web:")}
    assert matching(query={"skip": "any"}) == (optout | dedup) & set(ids)
    assert matching(query={"skip": "nsfw"}) == set()  # a reason no sidecar names
    assert table.count_rows(filter=facets.corpus_filter(facets.Query(skip="optout"), sets)) == 2
    cats = matching(query={"dup": "unique"}, full_text_query="cat", prefilter=True, limit=1000)
    assert cats == {i for n, i in enumerate(ids) if n % 3 == 0} - duplicate - kept


def test_ids_and_strings_are_checked_and_quoted():
    assert catalog.valid_id("web:0a1b") == "web:0a1b"
    for bad in ("../x", "web:a/b", "web:a b", "web:a'--", "", "WEB:abc"):
        with pytest.raises(catalog.NotFound):
            catalog.valid_id(bad)
    # The browser quotes through the storage layer's one filter builder.
    assert filters.sql_string("it's") == "'it''s'"
    assert filters.in_filter("id", []) == "FALSE"  # no ids select no rows


def test_opt_out_request_is_a_valid_pipeline_request(tmp_path):
    when = datetime(2026, 12, 1, 10, 0, tzinfo=UTC)
    path = write_request(tmp_path, "web:abc", "ticket 7\n<b>", now=when, door="browser")
    assert path.parent.path == tmp_path / "opt_outs" and path.name.startswith("browser-")
    record = json.loads(path.read_text())
    assert record == {"key_type": "id", "value": "web:abc", "timestamp": when.isoformat(),
                      "reference": "ticket 7 <b>", "door": "browser"}
    parsed = parse_directory(path.parent)
    assert not parsed.errors and [r.value for r in parsed.requests] == ["web:abc"]
    assert files_requesting(tmp_path, "web:abc") == [path.name]
    assert files_requesting(tmp_path, "web:other") == []
    assert not list((tmp_path / "opt_outs").glob(".*"))  # no temporary file left behind


def test_rate_limit_is_a_sliding_window_per_key():
    now = [0.0]
    limit = RateLimit(2, 60.0, clock=lambda: now[0])
    assert [limit.allow("alice") for _ in range(3)] == [True, True, False]
    assert limit.allow("bob")  # a limit per curator
    now[0] = 60.0
    assert limit.allow("alice")  # the first two left the window


def test_view_urls_only_when_the_browser_is_configured(monkeypatch):
    monkeypatch.delenv(links.BROWSER_URL_ENV, raising=False)
    assert links.view_url("corpus") is None
    monkeypatch.setenv(links.BROWSER_URL_ENV, "http://127.0.0.1:8080/")
    assert links.view_url("corpus") == "http://127.0.0.1:8080/"
    assert links.view_url("captions", "web") == "http://127.0.0.1:8080/?source=web"
    assert links.view_url("skip_lists", "a_b") == "http://127.0.0.1:8080/?source=a_b&skip=any"
    assert links.view_url("duplicates") == "http://127.0.0.1:8080/duplicates"
    assert links.view_url("unknown_asset") is None


def test_every_per_source_step_of_the_registry_has_a_source_view(monkeypatch):
    """The views follow the registry: a per-source step added there gets its link."""
    from prx_assets.registry import PER_SOURCE, STEPS

    monkeypatch.setenv(links.BROWSER_URL_ENV, "http://ui:8080")
    per_source = [s.asset for s in STEPS if s.partitioning == PER_SOURCE]
    assert {"raw_images", "attributes", "image_embeddings"} <= set(per_source)
    for asset in per_source:
        assert links.view_url(asset, "web").startswith("http://ui:8080/?source=web"), asset
    assert links.view_url("subsets", "small") is None  # partitioned by subset: no grid view


def test_membership_counts_match_the_ids_over_several_fragments(tmp_path):
    import lance
    import pyarrow as pa

    ids = [f"s:{i:04d}" for i in range(1000)]
    table = lance.write_dataset(pa.table({"id": ids, "n": list(range(1000))}),
                                str(tmp_path / "t.lance"), max_rows_per_file=300)
    table.delete("n % 7 = 0")  # holes: row addresses are not positions
    assert len(table.get_fragments()) == 4
    rng = np.random.default_rng(0)
    chosen = {name: set(rng.choice(ids, 150, replace=False).tolist()) for name in ("a", "b")}
    sets = {"dup": {name: facets.IdSet.of(v) for name, v in chosen.items()}, "skip": {}}
    members = facets.Membership.build(table, sets, batch_rows=128)
    rows = table.to_table(columns=["id"], filter="n % 3 = 0", with_row_address=True)
    addresses = facets.RowAddresses(rows.column("_rowaddr").to_numpy())
    for name, wanted in chosen.items():
        expected = sum(1 for i in rows.column("id").to_pylist() if i in wanted)
        assert members.count(("dup", name), addresses) == expected
    assert members.count(("skip", "none"), addresses) == 0


def test_sources_of_a_table_are_listed_from_a_bucket(s3_root):
    """On an object-store root the per-source tables are listed from the bucket (one
    listing), not taken from the sources file."""
    import pyarrow as pa

    from prx_assets.storage.lance_tables import overwrite_rows
    from prx_assets.storage.layout import Storage

    store = Storage(s3_root)
    tables = catalog.Catalog(store)
    assert tables.sources_of("raw_images") == []
    for source in ("web", "tars"):
        rows = pa.table({"id": [f"{source}:1"]})
        overwrite_rows(store.table("raw_images", source), rows, rows.schema)
    assert catalog.Catalog(store).sources_of("raw_images") == ["tars", "web"]
    assert catalog.Catalog(store).sources_of("captions") == []


def test_the_shape_facet_is_a_grid_of_tiers_by_aspect_ratio():
    from prx_assets.browser.queries import shape_grid

    grid = shape_grid([("512:608x432", 5), ("512:512x512", 2), ("1024:1024x1024", 1),
                       ("1024:1216x864", 3), ("512:432x608", 1)])
    assert grid.aspects == [0.71, 1.0, 1.41]
    assert grid.rows == [(512, [("432x608", 1), ("512x512", 2), ("608x432", 5)]),
                         (1024, [None, ("1024x1024", 1), ("1216x864", 3)])]
    assert shape_grid([]).rows == []


def test_opt_in_lists_are_counted_apart_from_what_is_skipped_by_default():
    """The grid's header, badges, facets and `skip=any` count skips as the loader applies
    them by default; the balance list and ablations are opt-in, shown as such."""
    from prx_assets.browser.queries import fate, fate_counts, opt_in_words

    sets = {"dup": {"duplicate": facets.IdSet.of(["s:01"]), "kept": facets.IdSet.of(["s:02"])},
            "skip": {"dedup": facets.IdSet.of(["s:01"]), "optout": facets.IdSet.of(["s:03"]),
                     "balance": facets.IdSet.of(["s:03", "s:04", "s:05"]),
                     "no_blue": facets.IdSet.of(["s:05"])}}
    assert fate("s:01", sets) == ("removed", "removed: duplicate")
    assert fate("s:03", sets) == ("skipped", "skipped: optout")  # balance too: skipped anyway
    assert fate("s:04", sets) == ("trains", "trains · in the balance list, opt-in")
    assert fate("s:05", sets) == ("trains", "trains · in the balance, no_blue lists, opt-in")
    assert fate("s:06", sets) == ("trains", "trains")
    assert fate_counts(10, sets) == {"trains": 8, "skipped": 1, "removed": 1,
                                     "opt_in": {"balance": 3, "no_blue": 1}}
    assert opt_in_words([]) == ""
    where = facets.corpus_filter(facets.Query(skip="any"), sets)
    table = pa.table({"id": [f"s:{n:02d}" for n in range(1, 7)]})
    assert table.filter(where).column("id").to_pylist() == ["s:01", "s:03"]
    where = facets.corpus_filter(facets.Query(skip="balance"), sets)  # an opt-in list, named
    assert table.filter(where).column("id").to_pylist() == ["s:03", "s:04", "s:05"]
