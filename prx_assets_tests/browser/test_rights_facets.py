"""Reserved samples stay in the browser: a `reserved` badge on their tiles, a reservation
and a license facet, and the signal, license and attribution on the sample page. The corpus
and raw_images are written straight into tables (no pipeline run, no browser)."""

from __future__ import annotations

import io

import pyarrow as pa
import pytest
from PIL import Image

from prx_assets.browser.app import create_app
from prx_assets.browser.facets import Query, attribute_facets, corpus_filter
from prx_assets.stages.corpus.corpus import CORPUS_SCHEMA
from prx_assets.stages.ingest.raw_rows import RAW_IMAGES_SCHEMA
from prx_assets.storage.lance_tables import overwrite_rows
from prx_assets.storage.layout import Storage
from prx_assets.storage.tables import CORPUS, RAW_IMAGES
from prx_assets.testing.served_app import ServedApp
from prx_assets_tests.browser.test_auth import Client

RESERVATIONS = {"web:0": ("none", "cc0"), "web:1": ("prohibited", "cc-by-4.0"),
                "web:2": ("constrained", "cc-by-4.0")}
SIGNAL = "xmp=plus:DataMining=DMI-PROHIBITED-AIMLTRAINING"


def _jpeg() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (32, 32), (90, 120, 30)).save(out, "JPEG")
    return out.getvalue()


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("rights_corpus")
    storage = Storage(str(root))
    rows = [{"id": i, "source": "web", "tier": 512, "width": 512, "height": 512,
             "caption": f"picture {i}", "label": "visual", "phash": n, "thumbnail": _jpeg(),
             "reservation": reservation, "license": license}
            for n, (i, (reservation, license)) in enumerate(RESERVATIONS.items())]
    overwrite_rows(storage.table(CORPUS), pa.Table.from_pylist(rows, schema=CORPUS_SCHEMA),
                   CORPUS_SCHEMA)
    row = {**dict.fromkeys(RAW_IMAGES_SCHEMA.names), "id": "web:1", "source": "web",
           "source_key": "000.tar/s1", "status": "ok", "format": "jpeg", "n_bytes": 1,
           "license": "cc-by-4.0", "license_url": "javascript:alert(1)",
           "attribution": "Ann Example", "reservation": "prohibited",
           "reservation_signal": SIGNAL}
    raw = pa.Table.from_pylist([row], schema=RAW_IMAGES_SCHEMA)
    overwrite_rows(storage.table(RAW_IMAGES, "web"), raw, RAW_IMAGES_SCHEMA)
    return root


def test_reservation_and_license_facets_filter_and_count():
    rows = pa.table({"id": list(RESERVATIONS),
                     "reservation": [r for r, _ in RESERVATIONS.values()],
                     "license": [lic for _, lic in RESERVATIONS.values()]})
    query = Query.parse({"reservation": "prohibited"})
    assert query.filtered and query.params() == {"reservation": "prohibited"}
    assert rows.filter(corpus_filter(query, None)).column("id").to_pylist() == ["web:1"]
    assert attribute_facets(rows)["license"] == [("cc-by-4.0", 2), ("cc0", 1)]
    from prx_assets.browser.catalog import BadQuery

    with pytest.raises(BadQuery, match="reservation"):
        Query.parse({"reservation": "maybe"})
    with pytest.raises(BadQuery, match="license"):
        Query.parse({"license": "<script>"})


def test_reserved_tiles_carry_a_badge_and_the_sample_page_the_signal(root):
    with ServedApp(root, create_app(root)) as served:
        client = Client(served.url)
        status, _, grid = client.request("GET", "/")
        assert status == 200
        assert grid.count('class="badge reserved"') == 2
        assert 'data-facet="reservation"' in grid and 'data-facet="license"' in grid
        status, _, only = client.request("GET", "/?reservation=constrained")
        assert status == 200 and 'data-id="web:2"' in only and 'data-id="web:1"' not in only
        status, _, page = client.request("GET", "/sample/web:1")
        assert status == 200
        assert SIGNAL in page and "Ann Example" in page
        assert 'data-reservation="prohibited"' in page
        assert "javascript:" not in page.split('id="license"')[1].split("</td>")[0]


def test_a_curator_clears_a_constrained_reservation_but_not_a_prohibition(root):
    import re

    from prx_assets.stages.opt_outs.requests import parse_directory
    from prx_assets.stages.opt_outs.rights import clearances_dir
    from prx_assets_tests.browser.test_auth import TOKEN, _auth

    with ServedApp(root, create_app(root, _auth())) as served:
        anonymous = Client(served.url)
        assert 'id="login-needed"' in anonymous.request("GET", "/sample/web:2/clear-rights")[2]
        assert anonymous.request("POST", "/sample/web:2/clear-rights",
                                 {"token": "x", "confirm": "yes"})[0] == 401
        curator = Client(served.url)
        assert curator.login(TOKEN) == 303
        assert 'id="clear-rights"' in curator.request("GET", "/sample/web:2")[2]
        page = curator.request("GET", "/sample/web:2/clear-rights")[2]
        token = re.search(r'name="token" value="([^"]+)"', page).group(1)
        assert curator.request("GET", "/sample/web:1/clear-rights")[0] == 409
        assert curator.request("POST", "/sample/web:1/clear-rights",
                               {"token": token, "confirm": "yes"})[0] == 409
        status, headers, _ = curator.request("POST", "/sample/web:2/clear-rights",
                                             {"token": token, "confirm": "yes",
                                              "reference": "licence read"})
        assert status == 303 and headers["location"] == "/sample/web:2?cleared=1"
    audit = parse_directory(clearances_dir(Storage(str(root)))).requests
    assert [(r.value, r.requested_by, r.door, r.reference) for r in audit] == [
        ("web:2", "alice", "browser", "licence read")]
