import pytest
from PIL import UnidentifiedImageError

from prx_assets.stages.captions.captioners import CaptionerSpec, model_image
from prx_assets.stages.captions.captions import (
    STATUS_EMPTY,
    STATUS_OK,
    STATUS_REFUSED,
    active_caption_filter,
    clean_caption,
    load_prompt,
    word_histogram,
)
from prx_assets.storage.refs import TableRef
from prx_assets.testing.images import jpeg_bytes


def test_caption_version_names_everything_that_changes_a_caption():
    base = CaptionerSpec(backend="transformers", model="/models/a")
    same = CaptionerSpec(backend="transformers", model="/models/a", batch_size=64, concurrency=4)
    assert base.version() == same.version()  # throughput knobs are not part of the version
    assert base.version().startswith("transformers-") and len(base.version()) == 25
    for changed in (CaptionerSpec(backend="transformers", model="/models/b"),
                    CaptionerSpec(backend="transformers", model="/models/a", temperature=0.7),
                    CaptionerSpec(backend="transformers", model="/models/a", image_budget=1024),
                    CaptionerSpec(backend="transformers", model="/models/a", fixed_length=True),
                    CaptionerSpec(backend="vllm", model="/models/a")):
        assert changed.version() != base.version()
    assert CaptionerSpec().version() == CaptionerSpec(image_budget=1, temperature=0.9).version()


def test_fixed_length_asks_vllm_to_ignore_the_end_of_sequence():
    spec = CaptionerSpec(backend="vllm", model="m", max_tokens=200)
    assert "ignore_eos" not in spec.sampling()  # production versions stay as they were
    fixed = CaptionerSpec(backend="vllm", model="m", max_tokens=200, fixed_length=True)
    assert fixed.sampling() == {**spec.sampling(), "ignore_eos": True}


def test_spec_refuses_incomplete_configurations():
    with pytest.raises(ValueError, match="backend 'clip'"):
        CaptionerSpec(backend="clip")
    with pytest.raises(ValueError, match="needs a model"):
        CaptionerSpec(backend="vllm")
    with pytest.raises(ValueError, match="endpoint"):
        CaptionerSpec(backend="openai", model="m")


def test_prompt_states_the_rules_in_our_words():
    prompt = load_prompt()
    assert "one paragraph of 100 to 200 words" in prompt
    for rule in ("lighting", "colours", "overlay", "double quotes", "metaphor"):
        assert rule in prompt
    with pytest.raises(FileNotFoundError, match="no caption prompt named 'nope'"):
        load_prompt("nope")


@pytest.mark.parametrize("raw, status, expected", [
    ("  A red chair\n\n stands   on a grey floor. ", STATUS_OK,
     "A red chair stands on a grey floor."),
    ("Caption: A dog lies on grass.", STATUS_OK, "A dog lies on grass."),
    ("A red chair stands on a grey floor. A lamp hangs above it. The wall beh", STATUS_OK,
     "A red chair stands on a grey floor. A lamp hangs above it."),
    ("a caption with no full stop at all", STATUS_OK, "a caption with no full stop at all"),
    ("I'm sorry, but I can't help with that.", STATUS_REFUSED, None),
    ("As an AI, I cannot describe people.", STATUS_REFUSED, None),
    ("   \n ", STATUS_EMPTY, ""),
    (None, STATUS_EMPTY, ""),
])
def test_clean_caption(raw, status, expected):
    clean = clean_caption(raw)
    assert clean.status == status
    if expected is not None:
        assert clean.caption == expected
        assert clean.n_words == len(expected.split())


def test_active_filter_and_histogram():
    assert active_caption_filter("vllm-0123456789ab") == \
        "caption_version = 'vllm-0123456789ab' AND status = 'ok'"
    with pytest.raises(ValueError):
        active_caption_filter("x' OR '1'='1")
    hist = dict(word_histogram([10, 120, 150, 199, 200, 420]))
    assert hist == {"0-49": 1, "50-99": 0, "100-149": 1, "150-199": 2, "200-249": 1,
                    "250-299": 0, "300+": 1}


def test_model_image_respects_the_pixel_budget_and_never_upscales():
    big = model_image(jpeg_bytes(1024, 768), 448 * 448)
    assert big.mode == "RGB" and big.width * big.height <= 448 * 448 * 1.01
    assert abs(big.width / big.height - 1024 / 768) < 0.02
    small = model_image(jpeg_bytes(320, 240), 448 * 448)
    assert small.size == (320, 240)
    with pytest.raises(UnidentifiedImageError):
        model_image(b"not a jpeg", 1000)


def test_kept_rows_are_read_by_lance_without_images_unless_a_model_needs_them(ray_session,
                                                                             tmp_path):
    import lance
    import pyarrow as pa

    from prx_assets.stages.captions.runs import read_kept

    uri = tmp_path / "bucketed.lance"
    lance.write_dataset(pa.table({"id": ["a", "b", "c"], "status": ["ok", "too_small", "ok"],
                                  "image": pa.array([b"x", None, b"z"], pa.large_binary())}),
                        uri)
    source = read_kept(TableRef.of(uri), CaptionerSpec()).take_all()
    assert sorted(r["id"] for r in source) == ["a", "c"]
    assert set(source[0]) == {"id", "status"}  # the `original` backend reads no image bytes
    model = CaptionerSpec(backend="openai", model="m", endpoint="http://127.0.0.1:1/v1")
    assert {r["image"] for r in read_kept(TableRef.of(uri), model).take_all()} == {b"x", b"z"}
