"""A source's corpus update writes only the rows that differ, and a row whose image is
unchanged keeps its thumbnail (read back, not decoded again)."""

import hashlib
import io
import shutil

import lance
import numpy as np
import pyarrow as pa
from PIL import Image

from prx_assets.models.embeddings import MiniLMEmbedder
from prx_assets.stages.corpus.corpus import (
    MAX_IN_IDS,
    build_corpus,
    thumbnail,
    update_corpus,
)
from prx_assets.stages.corpus.delta import ROW_ADDRESS, columns_equal, plan_delta
from prx_assets.stages.images.stage import BUCKETED_SCHEMA
from prx_assets.storage.lance_tables import overwrite_rows
from prx_assets.storage.refs import TableRef
from prx_assets.testing.corpus_tables import write_source
from prx_assets.testing.images import jpeg_bytes
from prx_assets.testing.labelled_captions import TEST_CAPTIONS

ROWS = [("heron", TEST_CAPTIONS["visual"][0], "visual"),
        ("bakery", TEST_CAPTIONS["visual"][1], "visual"),
        ("couple", TEST_CAPTIONS["nsfw"][0], "nsfw"),
        ("budget", TEST_CAPTIONS["text"][0], "text")]
NEW_CAPTION = ("A bakery counter with croissants and loaves in wicker baskets, a chalkboard "
               "menu behind them and morning light through the window.")


class OneAtATime(MiniLMEmbedder):
    """Each caption embedded alone: a batch's padding moves the last bits of a vector, and
    these tests write the same caption in batches of other sizes."""

    def embed(self, texts):
        return np.concatenate([super(OneAtATime, self).embed([t]) for t in texts]) if texts \
            else super().embed(texts)


def _rows(**columns) -> pa.Table:
    n = len(columns["id"])
    columns.setdefault("caption", ["c"] * n)
    columns.setdefault("made_from", [f"m{i}" for i in columns["id"]])
    columns.setdefault("subjects", [["a", "b"]] * n)
    columns.setdefault("embedding", [[1.0, 2.0]] * n)
    return pa.table({**columns, "embedding": pa.array(columns["embedding"],
                                                      pa.list_(pa.float32(), 2))})


def _held(table: pa.Table) -> pa.Table:
    return table.append_column(ROW_ADDRESS, pa.array(range(100, 100 + table.num_rows),
                                                     pa.uint64()))


def test_equal_rows_are_left_alone_and_changes_are_found_in_every_kind_of_column():
    held = _held(_rows(id=["a", "b", "c", "d", "e", "gone"]))
    expected = _rows(id=["a", "b", "c", "d", "e", "new"],
                     caption=["c", "other", "c", "c", "c", "c"],
                     made_from=["ma", "mb", "changed", "md", "me", "mnew"],
                     subjects=[["a", "b"], ["a", "b"], ["a", "b"], ["a", "x"], ["a", "b"],
                               ["a"]],
                     embedding=[[1.0, 2.0]] * 4 + [[1.0, 2.5], [1.0, 2.0]])
    delta = plan_delta(expected, held)
    assert delta.write.column("id").to_pylist() == ["b", "c", "d", "e", "new"]
    # b (caption), d (subjects) and e (embedding) keep their thumbnails; c's image changed.
    assert delta.carried.to_pylist() == [101, None, 103, 104, None]
    assert sorted(delta.delete.to_pylist()) == ["b", "c", "d", "e", "gone"]
    assert delta.needing_thumbnail().column("id").to_pylist() == ["c", "new"]
    assert delta.with_thumbnail_kept().column(ROW_ADDRESS).to_pylist() == [101, 103, 104]


def test_nothing_changed_is_an_empty_delta_and_rewrite_all_still_carries_thumbnails():
    held = _held(_rows(id=["a", "b"]))
    expected = _rows(id=["b", "a"])
    assert plan_delta(expected, held).empty
    whole = plan_delta(expected, held, rewrite_all=True)
    assert whole.carried.to_pylist() == [101, 100]
    assert sorted(whole.delete.to_pylist()) == ["a", "b"]


def test_nulls_compare_equal_to_nulls_only():
    a = pa.array([None, "x", None, "y"])
    b = pa.array([None, None, "x", "y"])
    assert columns_equal(a, b).tolist() == [True, False, False, True]
    lists = pa.array([None, [], ["x"], ["x", "y"], ["x", None]])
    other = pa.array([None, None, ["x"], ["x", "z"], ["x", None]])
    assert columns_equal(lists, other).tolist() == [True, False, True, False, True]


def _set_images(tables, images: dict[str, bytes], made_from: dict[str, bytes] | None = None
                ) -> None:
    """Give rows their own image bytes, with the raw sha256 of `made_from`'s bytes where
    given (a row claiming to be made from other bytes than it holds), else of their own."""
    bucketed = lance.dataset(str(tables.bucketed)).to_table()
    ids = bucketed.column("id").to_pylist()
    blobs = [images.get(i, b) for i, b in zip(ids, bucketed.column("image").to_pylist(),
                                               strict=True)]
    origins = [(made_from or {}).get(i, b) for i, b in zip(ids, blobs, strict=True)]
    digests = [hashlib.sha256(b).hexdigest() if b else None for b in origins]
    for column, values, kind in (("image", blobs, pa.large_binary()),
                                 ("raw_sha256", digests, pa.string())):
        bucketed = bucketed.set_column(bucketed.schema.get_field_index(column), column,
                                       pa.array(values, kind))
    overwrite_rows(tables.bucketed, bucketed, BUCKETED_SCHEMA)


def _corpus_rows(uri) -> dict:
    rows = lance.dataset(str(uri)).to_table().to_pylist()
    assert len({r["id"] for r in rows}) == len(rows), "duplicate ids"
    return {r["id"]: r for r in rows}


def test_an_update_writes_the_changed_rows_and_keeps_unchanged_thumbnails(ray_session, tmp_path):
    root, embedder = tmp_path / "lance", OneAtATime(threads=1)
    images = {f"web:{key}": jpeg_bytes(640, 480, seed) for seed, (key, _, _) in
              enumerate(ROWS, start=20)}
    tables = write_source(root, "web", ROWS[:3], embedder)
    _set_images(tables, images)
    corpus = TableRef.of(root / "corpus.lance")
    build_corpus(corpus, [tables.pinned()])
    before = _corpus_rows(corpus)
    assert len({r["thumbnail"] for r in before.values()}) == 3

    # One image added, one caption changed, one image's bytes changed; heron's stored
    # bytes are broken but it is made from the same raw bytes: its thumbnail is kept, not
    # made again (which would fail).
    rows = [ROWS[0], (ROWS[1][0], NEW_CAPTION, "visual"), ROWS[2], ROWS[3]]
    shutil.rmtree(root / "captions")  # the fixture appends captions
    tables = write_source(root, "web", rows, embedder)
    changed = {**images, "web:couple": jpeg_bytes(640, 480, 99)}
    _set_images(tables, {**changed, "web:heron": b"not a jpeg"}, made_from=changed)

    report = update_corpus(corpus, [tables.pinned()], [], [])
    assert report.inserted == {"web": 3}  # bakery (caption), couple (image), budget (new)
    assert report.deleted == {"web": 2}
    after = _corpus_rows(corpus)
    assert set(after) == {"web:heron", "web:bakery", "web:couple", "web:budget"}
    assert after["web:heron"] == before["web:heron"]
    assert after["web:bakery"]["thumbnail"] == before["web:bakery"]["thumbnail"]
    assert after["web:bakery"]["caption"] == NEW_CAPTION
    assert after["web:couple"]["thumbnail"] == thumbnail(changed["web:couple"])
    assert after["web:couple"]["thumbnail"] != before["web:couple"]["thumbnail"]
    assert max(Image.open(io.BytesIO(after["web:budget"]["thumbnail"])).size) == 256

    assert update_corpus(corpus, [tables.pinned()], [], []).inserted == {"web": 0}


def test_many_deletions_replace_the_source_whole_and_still_carry_thumbnails(
        ray_session, tmp_path, monkeypatch):
    import prx_assets.stages.corpus.corpus as corpus_module

    root, embedder = tmp_path / "lance", OneAtATime(threads=1)
    tables = write_source(root, "web", ROWS, embedder)
    corpus = TableRef.of(root / "corpus.lance")
    build_corpus(corpus, [tables.pinned()])
    before = _corpus_rows(corpus)
    shutil.rmtree(root / "captions")  # the fixture appends captions
    tables = write_source(root, "web", [ROWS[0], *[(k, NEW_CAPTION, l)
                                                    for k, _, l in ROWS[1:]]], embedder)
    # Every image broken but made from the same bytes: no thumbnail may be made again.
    image = lance.dataset(str(tables.bucketed)).to_table().column("image")[0].as_py()
    _set_images(tables, {f"web:{k}": b"broken" for k, _, _ in ROWS},
                made_from={f"web:{k}": image for k, _, _ in ROWS})
    monkeypatch.setattr(corpus_module, "MAX_IN_IDS", 2)
    assert MAX_IN_IDS > 2
    report = update_corpus(corpus, [tables.pinned()], [], [])
    assert report.inserted == {"web": 4} and report.deleted == {"web": 4}
    after = _corpus_rows(corpus)
    assert {i: r["thumbnail"] for i, r in after.items()} == \
        {i: r["thumbnail"] for i, r in before.items()}
