"""The browser's pure parts, without a browser: near-duplicate pairs, query parsing, the
opt-out request writer and the metadata links."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import numpy as np
import pytest

from prx_assets.browser import links, queries
from prx_assets.browser.optout import Tokens, pending_requests, write_request
from prx_assets.stages.opt_outs.opt_outs import parse_directory


def _brute_pairs(hashes: np.ndarray, max_distance: int) -> set[tuple[int, int, int]]:
    values = hashes.view(np.uint64)
    found = set()
    for i in range(len(values)):
        for j in range(i + 1, len(values)):
            d = bin(int(values[i] ^ values[j])).count("1")
            if 1 <= d <= max_distance:
                found.add((i, j, d))
    return found


def test_near_pairs_find_every_pair_within_four_bits():
    rng = np.random.default_rng(3)
    base = rng.integers(-(1 << 62), 1 << 62, 60, dtype=np.int64)
    hashes = [base]
    for bits in (1, 2, 3, 4, 5, 9):  # copies flipped in random bit positions, some far
        flipped = base.copy().view(np.uint64)
        for row in range(len(flipped)):
            for bit in rng.choice(64, bits, replace=False):
                flipped[row] ^= np.uint64(1) << np.uint64(bit)
        hashes.append(flipped.view(np.int64))
    unique = np.unique(np.concatenate(hashes))
    got = set(queries.near_pairs(unique))
    assert got == _brute_pairs(unique, 4)
    assert {d for _, _, d in got} == {1, 2, 3, 4}


def test_query_parse_validates_every_parameter():
    query = queries.Query.parse({"q": "  a cat ", "source": "web", "label": "text",
                                 "tier": "1024", "shape": "512x512", "dup": "kept",
                                 "skip": "optout", "page": "2"})
    assert (query.text, query.tier, query.page) == ("a cat", 1024, 2)
    assert query.params(source="") == {"q": "a cat", "label": "text", "tier": "1024",
                                       "shape": "512x512", "dup": "kept", "skip": "optout"}
    where = queries.corpus_filter(queries.Query(source="web", tier=512, shape="64x32"), None)
    assert where == "source = 'web' AND tier = 512 AND width = 64 AND height = 32"
    for bad in ({"source": "a'b"}, {"label": "cat"}, {"tier": "1 OR 1"}, {"shape": "1x1'"},
                {"dup": "maybe"}, {"skip": "x y"}, {"page": "-1"}, {"page": "1e9"}):
        with pytest.raises(queries.BadQuery):
            queries.Query.parse(bad)
    with pytest.raises(queries.NotFound):
        queries.Query.parse({"similar": "../../etc/passwd"})


def test_ids_and_strings_are_checked_and_quoted():
    assert queries.valid_id("web:0a1b") == "web:0a1b"
    for bad in ("../x", "web:a/b", "web:a b", "web:a'--", "", "WEB:abc"):
        with pytest.raises(queries.NotFound):
            queries.valid_id(bad)
    # The browser quotes through the storage layer's one filter builder.
    assert queries.sql_string("it's") == "'it''s'"
    assert queries.in_filter("id", []) == "FALSE"  # no ids select no rows


def test_opt_out_request_is_a_valid_pipeline_request(tmp_path):
    when = datetime(2026, 12, 1, 10, 0, tzinfo=timezone.utc)
    path = write_request(tmp_path, "web:abc", "ticket 7\n<b>", now=when)
    assert path.parent == tmp_path / "opt_outs" and path.name.startswith("browser-")
    record = json.loads(path.read_text())
    assert record == {"key_type": "id", "value": "web:abc", "timestamp": when.isoformat(),
                      "reference": "ticket 7 <b>"}
    parsed = parse_directory(tmp_path / "opt_outs")
    assert not parsed.errors and [r.value for r in parsed.requests] == ["web:abc"]
    assert pending_requests(tmp_path, "web:abc") == [path.name]
    assert pending_requests(tmp_path, "web:other") == []
    assert not list((tmp_path / "opt_outs").glob(".*"))  # no temporary file left behind


def test_tokens_are_per_sample_and_per_server():
    tokens = Tokens()
    token = tokens.token("web:abc")
    assert tokens.valid("web:abc", token)
    assert not tokens.valid("web:abd", token)
    assert not tokens.valid("web:abc", "")
    assert not Tokens().valid("web:abc", token)


def test_view_urls_only_when_the_browser_is_configured(monkeypatch):
    monkeypatch.delenv(links.BROWSER_URL_ENV, raising=False)
    assert links.view_url("corpus") is None
    monkeypatch.setenv(links.BROWSER_URL_ENV, "http://127.0.0.1:8080/")
    assert links.view_url("corpus") == "http://127.0.0.1:8080/"
    assert links.view_url("captions", "web") == "http://127.0.0.1:8080/?source=web"
    assert links.view_url("skip_lists", "a_b") == "http://127.0.0.1:8080/?source=a_b&skip=any"
    assert links.view_url("duplicates") == "http://127.0.0.1:8080/duplicates"
    assert links.view_url("unknown_asset") is None


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
    sets = {"dup": {name: queries.IdSet.of(v) for name, v in chosen.items()}, "skip": {}}
    members = queries.Membership.build(table, sets, batch_rows=128)
    rows = table.to_table(columns=["id"], filter="n % 3 = 0", with_row_address=True)
    addresses = queries.RowAddresses(rows.column("_rowaddr").to_numpy())
    for name, wanted in chosen.items():
        expected = sum(1 for i in rows.column("id").to_pylist() if i in wanted)
        assert members.count(("dup", name), addresses) == expected
    assert members.count(("skip", "none"), addresses) == 0


def test_sources_of_a_table_are_listed_from_a_bucket(s3_root):
    """On an object-store root the per-source tables are listed from the bucket (one
    listing), not taken from the sources file."""
    import lance
    import pyarrow as pa

    from prx_assets.storage.layout import Storage

    store = Storage(s3_root)
    catalog = queries.Catalog(store)
    assert catalog.sources_of("raw_images") == []
    for source in ("web", "tars"):
        lance.write_dataset(pa.table({"id": [f"{source}:1"]}), store.table("raw_images", source),
                            storage_options=store.lance_options())
    assert queries.Catalog(store).sources_of("raw_images") == ["tars", "web"]
    assert queries.Catalog(store).sources_of("captions") == []
