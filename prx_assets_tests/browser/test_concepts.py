"""The concept facet, the concept pages and "more like this" in image space, over HTTP.

A small corpus of 12 samples in two sources is written here with the stages' own writers
(no Ray): three caption-embedding groups of 4 (directions e0, e0 + e1/2, e2, so group 1 is
group 0's nearest), concepts from `concept_rows` (level 1: the three groups; level 2: groups
0 and 1 together), and image embeddings in another space where sample i points along
e(i mod 4), so a sample's image neighbours cross groups and sources.
"""

from __future__ import annotations

import re
import urllib.error
import urllib.request

import numpy as np
import pyarrow as pa
import pytest

from prx_assets.models.embeddings import EMBEDDING_DIM
from prx_assets.stages.corpus.corpus import CORPUS_SCHEMA
from prx_assets.stages.semantic.concepts import ConceptTree
from prx_assets.stages.semantic.embeddings import write_embeddings
from prx_assets.stages.semantic.spaces import CONCEPTS_SCHEMA, concept_rows
from prx_assets.storage.lance_tables import overwrite_rows
from prx_assets.storage.layout import Storage
from prx_assets.storage.tables import CONCEPTS, CORPUS, IMAGE_EMBEDDINGS
from prx_assets.testing.served_app import ServedApp

IDS = [f"web:{i}" for i in range(6)] + [f"stock:{i}" for i in range(6, 12)]
GROUPS = np.repeat([0, 1, 2], 4)  # level-1 cluster of each sample
ENCODER = "clip_vision_model:tiny:test"


def _caption_vectors(rng: np.random.Generator) -> np.ndarray:
    basis = np.eye(EMBEDDING_DIM, dtype=np.float32)
    centres = [basis[0], basis[0] + 0.5 * basis[1], basis[2]]
    return np.stack([centres[g] + 0.01 * rng.standard_normal(EMBEDDING_DIM) for g in GROUPS]
                    ).astype(np.float32)


def _write_corpus(store: Storage) -> None:
    vectors = _caption_vectors(np.random.default_rng(0))
    rows = [{"id": sample_id, "source": sample_id.split(":")[0], "tier": 256, "width": 256,
             "height": 256, "caption": f"caption of group {g} sample {sample_id}",
             "label": None, "embedding": vectors[i].tolist()}
            for i, (sample_id, g) in enumerate(zip(IDS, GROUPS, strict=True))]
    table = pa.Table.from_pylist(rows, schema=CORPUS_SCHEMA)
    overwrite_rows(store.table(CORPUS), table, CORPUS_SCHEMA)


def _write_concepts(store: Storage) -> None:
    tree = ConceptTree(levels=[GROUPS, np.array([0, 0, 1])[GROUPS]],
                       parents=[np.array([0, 0, 1])],
                       centroids=[np.zeros((3, 2)), np.zeros((2, 2))])
    rows = concept_rows(pa.array(IDS, pa.string()), tree.levels, np.ones(len(IDS), bool))
    overwrite_rows(store.table(CONCEPTS), rows, CONCEPTS_SCHEMA)


def _write_image_embeddings(store: Storage) -> None:
    for source in ("web", "stock"):
        mine = [i for i, sample_id in enumerate(IDS) if sample_id.startswith(source)]
        vectors = np.stack([np.eye(8)[i % 4] + 0.001 * i for i in mine]).astype(np.float32)
        batch = pa.table({"id": [IDS[i] for i in mine],
                          "embedding": pa.array(vectors.tolist(),
                                                pa.list_(pa.float32(), 8))})
        write_embeddings(store.table(IMAGE_EMBEDDINGS, source), [batch], ENCODER, [])


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    root = tmp_path_factory.mktemp("concepts_corpus")
    store = Storage(root)
    _write_corpus(store)
    _write_concepts(store)
    _write_image_embeddings(store)
    with ServedApp(root) as served:
        yield served


def _get(app: ServedApp, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(app.url + path, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def _facet_counts(html: str) -> dict[str, int]:
    section = html.split('data-facet="concept"', 1)[1].split("</section>", 1)[0]
    return {value: int(count) for value, count in re.findall(
        r'data-value="(\d+)">cluster \d+</a>\s*<span class="count" data-count="(\d+)"',
        section)}


def _tile_ids(html: str) -> list[str]:
    return re.findall(r'<figure class="tile" data-id="([^"]+)"', html)


def test_concept_facet_counts_levels_and_filters(app):
    status, html = _get(app, "/")
    assert status == 200
    assert 'data-level="2"' in html  # the top level is counted by default
    assert _facet_counts(html) == {"0": 8, "1": 4}
    _, leaves = _get(app, "/?level=1")
    assert _facet_counts(leaves) == {"0": 4, "1": 4, "2": 4}
    _, chosen = _get(app, "/?level=1&concept=2")
    assert sorted(_tile_ids(chosen)) == sorted(IDS[8:])
    # Counted among the matches: another facet narrows the concept counts.
    _, web = _get(app, "/?source=web&level=1")
    assert _facet_counts(web) == {"0": 4, "1": 2}
    assert _get(app, "/?concept=1")[0] == 400  # a cluster needs its level
    assert _get(app, "/?level=x")[0] == 400


def test_concept_page_samples_captions_and_nearest_clusters(app):
    status, html = _get(app, "/concept/1/0")
    assert status == 200
    assert '<span id="size">4</span>' in html
    assert sorted(_tile_ids(html)) == sorted(IDS[:4])
    assert "caption of group 0" in html
    nearest = re.findall(r'<a href="/concept/1/(\d+)" data-cluster', html)
    assert nearest == ["1", "2"]  # group 1's centre leans towards group 0's
    assert _get(app, "/concept/1/9")[0] == 404
    assert _get(app, "/concept/7/0")[0] == 404


def test_concept_page_refuses_numbers_beyond_a_cluster(app):
    """Numbers past int32 once reached the Lance filter and answered 500."""
    for path in ("/concept/1/99999999999", "/concept/99999999999/0"):
        status, html = _get(app, path)
        assert status == 400, path
        assert "a concept is a level up to" in html


def test_sample_page_links_its_concepts_and_image_space(app):
    status, html = _get(app, "/sample/web:5")
    assert status == 200
    assert 'href="/concept/1/1"' in html and "concept: level 1 cluster 1" in html
    assert 'href="/concept/2/0"' in html
    assert "space=image" in html


def test_more_like_this_in_image_space_crosses_sources(app):
    _, captions = _get(app, "/?similar=web:0")
    assert set(_tile_ids(captions)[:3]) == {"web:1", "web:2", "web:3"}  # its caption group
    status, images = _get(app, "/?similar=web:0&space=image")
    assert status == 200
    # web:0 points along e0 in image space, as web:4 and stock:8 do.
    assert set(_tile_ids(images)[:2]) == {"web:4", "stock:8"}
    assert 'id="space-toggle"' in images
    _, faceted = _get(app, "/?similar=web:0&space=image&source=stock")
    assert _tile_ids(faceted)[0] == "stock:8"
    assert "web:4" not in _tile_ids(faceted)
    assert _get(app, "/?similar=web:0&space=audio")[0] == 400
