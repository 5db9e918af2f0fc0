"""The browser's card pages over a source tree and a subset tree (served in process)."""

import urllib.error
import urllib.request

import pytest

from prx_assets.stages.shards import mds, plan
from prx_assets.stages.subsets.build import ActiveVersions, build_subset
from prx_assets.stages.subsets.definitions import parse_subset
from prx_assets.storage.layout import Storage
from prx_assets.testing.mds_corpus import ACTIVE, build_corpus, inputs_for
from prx_assets.testing.served_app import ServedApp


class Client:
    """GET over HTTP from the app served in a thread: (status, text)."""

    def __init__(self, url: str):
        self.url = url

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=30) as reply:
                return reply.status, reply.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()


@pytest.fixture()
def client(data_root):
    build_corpus(data_root, "web", per_shape=3)
    mds.write_mds_tree(inputs_for(data_root, "web"), data_root, "web",
                       plan.WriteOptions(parallel=False))
    build_subset(Storage(str(data_root)), parse_subset({"name": "few", "target_size": 4}),
                 ["web"], {"web": "cc-by-4.0"}, ActiveVersions(ACTIVE))
    with ServedApp(data_root) as app:
        yield Client(app.url)


def test_the_browser_lists_every_tree_and_shows_its_card(client):
    status, listing = client.get("/cards")
    assert status == 200
    assert 'href="/cards/source/web"' in listing and 'href="/cards/subset/few"' in listing
    status, subset = client.get("/cards/subset/few")
    assert status == 200 and "(4 samples)" in subset
    assert "<td>web</td><td>cc-by-4.0</td><td>4</td>" in subset
    assert "prx-assets mds-uri --subset few" in subset
    status, source = client.get("/cards/source/web")
    assert status == 200 and "source tree `web`" in source
    assert client.get("/cards/subset/nothing")[0] == 404
    assert client.get("/cards/table/web")[0] == 404


def test_a_source_card_shows_what_its_sidecars_skip_now(client, data_root):
    """The card file is written with the tree, before the source's skip lists: the page adds
    what the sidecars skip now, by default and in opt-in lists apart."""
    from prx_assets.storage.sidecars import sidecar_path, write_sidecar
    from prx_assets.storage.trees import current_tree

    rows = Storage(str(data_root)).table("mds_samples", "web").to_table().to_pylist()
    leaf, shard = rows[0]["leaf"], rows[0]["shard"]
    write_sidecar(sidecar_path(current_tree(data_root / "mds", "web") / leaf / shard),
                  {"dedup": [0], "balance": [0, 1]})
    status, source = client.get("/cards/source/web")
    assert status == 200
    assert "<th>skipped by default now</th><td>1 (dedup 1)</td>" in source
    assert "in the balance list, opt-in: 2" in source
    status, subset = client.get("/cards/subset/few")
    assert "<th>skipped by default now</th><td>0</td>" in subset
