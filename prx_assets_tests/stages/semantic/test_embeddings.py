import io

import numpy as np
import pyarrow as pa
import pytest
from PIL import Image

from prx_assets.stages.semantic.embeddings import (
    VisionEncoder,
    encoder_name,
    plan,
    read_space,
    write_embeddings,
)
from prx_assets.storage.refs import TableRef
from prx_assets.testing.tiny_vision import tiny_vision_tower


def jpeg(colour: tuple[int, int, int], side: int = 48) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (side, side), colour).save(out, "JPEG")
    return out.getvalue()


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_vision_tower_embeds_images_and_records_bad_bytes(tmp_path, kind):
    folder = tiny_vision_tower(tmp_path / kind, kind)
    encoder = VisionEncoder(str(folder))
    batch = pa.table({"id": ["a", "b", "c"],
                      "image": [jpeg((200, 10, 10)), b"not an image", jpeg((200, 10, 10))]})
    out = encoder(batch)
    vectors = out.column("embedding").to_pylist()
    assert out.column("error").to_pylist()[0] is None
    assert out.column("error").to_pylist()[1].startswith("decode")
    assert vectors[1] is None
    assert np.isclose(np.linalg.norm(vectors[0]), 1.0, atol=1e-5)
    assert np.allclose(vectors[0], vectors[2], atol=1e-5)  # same image, same vector
    assert encoder_name(folder).startswith(f"{kind}_vision_model:{kind}:")


def test_non_vision_checkpoint_is_refused(tmp_path):
    from transformers import BertConfig

    BertConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
               intermediate_size=8).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="neither CLIP nor SigLIP"):
        VisionEncoder(str(tmp_path))


def test_incremental_write_reuses_deletes_and_keeps_other_encoders(tmp_path):
    table = TableRef.of(tmp_path / "image_embeddings" / "web.lance")
    first = pa.table({"id": ["web:1", "web:2"], "embedding": [[3.0, 4.0], [1.0, 0.0]]})
    counts = write_embeddings(table, [first], "enc-a", removed=[])
    assert counts.written == 2 and counts.dim == 2
    write_embeddings(table, [pa.table({"id": ["web:1"], "embedding": [[0.0, 2.0]]})],
                     "enc-b", removed=[])
    todo = plan({"web:1", "web:3"}, table, "enc-a")
    assert (todo.todo, todo.reused, todo.removed) == (["web:3"], 1, ["web:2"])
    failed = pa.table({"id": ["web:3", "web:4"], "embedding": [[0.0, 1.0], None],
                       "error": [None, "decode: broken"]})
    counts = write_embeddings(table, [failed], "enc-a", removed=todo.removed)
    assert (counts.written, counts.failed, counts.errors) == (1, 1, ["decode: broken"])
    ids, vectors = read_space(table, "enc-a")
    assert sorted(ids.to_pylist()) == ["web:1", "web:3"]
    assert np.allclose(vectors[ids.to_pylist().index("web:1")], [0.6, 0.8])
    assert read_space(table, "enc-b")[0].to_pylist() == ["web:1"]


def test_an_encoder_of_another_size_replaces_the_table(tmp_path):
    table = TableRef.of(tmp_path / "web.lance")
    write_embeddings(table, [pa.table({"id": ["web:1"], "embedding": [[1.0, 0.0]]})], "a", [])
    counts = write_embeddings(table, [pa.table({"id": ["web:1", "web:2"],
                                                "embedding": [[1.0, 0, 0], [0, 1.0, 0]]})],
                              "b", [])
    assert counts.replaced and counts.written == 2
    assert read_space(table, "a")[0].to_pylist() == []
    assert sorted(read_space(table, "b")[0].to_pylist()) == ["web:1", "web:2"]
