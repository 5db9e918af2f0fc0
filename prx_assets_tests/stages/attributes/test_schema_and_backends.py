"""The attribute schema, its validator, the caption-derived default, structured decoding
with the tiny random model, and the vLLM path as configuration."""

import json
from pathlib import Path

import pyarrow as pa
import pytest
from ray.data.llm import vLLMEngineProcessorConfig

from prx_assets.stages.attributes import backends
from prx_assets.stages.attributes.caption_derived import (
    EMITTED,
    CaptionAttributer,
    check_descriptions,
    withheld_reason,
)
from prx_assets.stages.attributes.schema import (
    ORIGIN_CAPTION,
    STATUS_FAILED,
    STATUS_INVALID,
    STATUS_OK,
    Tagged,
    attribute_rows,
    attributes_schema,
    fields,
    json_schema,
    parse_record,
    validate,
)
from prx_assets.testing.tiny_vlm import build_tiny_qwen3_vl

HAND_LABELLED = Path(__file__).parents[2] / "fixtures" / "attribute_captions.jsonl"
GOOD = {"medium": "photo", "subjects": ["animal", "plant"], "people": "none",
        "visible_text": "none", "watermark": False, "setting": "outdoor",
        "lighting": "daylight", "composition": "wide", "style": "realistic",
        "technical_quality": 4, "aesthetic_quality": 3}


def test_every_attribute_is_a_typed_column_not_a_json_string():
    schema = attributes_schema()
    assert schema.field("medium").type == pa.string()
    assert schema.field("subjects").type == pa.list_(pa.string())
    assert schema.field("watermark").type == pa.bool_()
    assert schema.field("aesthetic_quality").type == pa.int8()
    assert {f.name for f in fields()} == set(json_schema()["required"])
    rows = attribute_rows([Tagged("a", "cv", GOOD, STATUS_OK, "model")], "attr-v")
    assert rows.schema == schema and rows.column("subjects").to_pylist() == [["animal", "plant"]]


def test_the_validator_names_each_way_a_record_breaks_the_schema():
    assert validate(GOOD) == []
    bad = {**GOOD, "medium": "hologram", "subjects": ["animal"] * 4, "watermark": "no",
           "technical_quality": 6, "mood": "happy"}
    del bad["style"]
    errors = " | ".join(validate(bad))
    for expected in ("unknown field 'mood'", "medium: 'hologram'", "subjects: 4 items",
                     "repeated items", "watermark: 'no' is not a boolean",
                     "technical_quality: 6", "missing 'style'"):
        assert expected in errors
    assert validate({"medium": "photo"}, partial=True) == []
    assert validate(True) == ["not an object: bool"]


def test_a_models_answer_is_parsed_or_refused_with_its_reason():
    assert parse_record(json.dumps(GOOD)) == (GOOD, None)
    assert parse_record("") == (None, "empty answer")
    record, reason = parse_record('{"medium": "photo", ')  # cut short by max_tokens
    assert record is None and reason.startswith("not JSON")
    record, reason = parse_record(json.dumps({**GOOD, "people": 3}))
    assert record is None and "people: 3" in reason


@pytest.fixture(scope="module")
def attributer():
    return CaptionAttributer()


def hand_labelled() -> list[dict]:
    return [json.loads(line) for line in HAND_LABELLED.read_text().splitlines() if line]


@pytest.fixture(scope="module")
def agreement():
    """Per hand-labelled field: (captions the zero-shot agrees on, captions holding the most
    common value), every field derived (the measurement behind EMITTED)."""
    rows = hand_labelled()
    every_field = tuple(f.name for f in fields())
    records = CaptionAttributer(emit=every_field).records([r["caption"] for r in rows])
    result = {}
    for name in (n for n in rows[0] if n != "caption"):
        agree = sum(rec.get(name) == row[name] for rec, row in zip(records, rows, strict=True))
        values = [row[name] for row in rows]
        result[name] = (agree, max(values.count(v) for v in set(values)))
    return result


def test_each_emitted_field_beats_always_answering_the_most_common_value(agreement):
    for name in EMITTED:
        agree, majority = agreement[name]
        assert agree > majority, f"{name}: {agree} agree, the most common value {majority}"


def test_the_fields_measured_below_that_baseline_are_withheld_with_the_reason(agreement):
    below = sorted(name for name, (agree, majority) in agreement.items() if agree <= majority)
    assert below == ["people", "visible_text"]  # measured: 10/32 against 22/32 and 18/32
    assert not set(below) & set(EMITTED)
    reason = withheld_reason()
    assert reason is not None
    for name in (*below, "subjects", "technical_quality"):
        assert f"{name}: " in reason
    assert not any(f"{name}: " in reason for name in EMITTED)


def test_caption_derived_records_validate_and_hold_only_the_emitted_fields(attributer):
    check_descriptions()
    rows = hand_labelled()
    records = attributer.records([r["caption"] for r in rows])
    for record in records:
        assert validate(record, partial=True) == []
        assert set(record) == set(EMITTED)
    # The watermark is read from the caption's words: a product's printed logo (hand
    # labelled "no watermark") is the one case of the set it gets wrong.
    wrong = [row["caption"] for rec, row in zip(records, rows, strict=True)
             if rec["watermark"] != row["watermark"]]
    assert len(wrong) == 1 and "sneaker" in wrong[0]
    every_field = CaptionAttributer(emit=tuple(f.name for f in fields()))
    record = every_field.records([rows[0]["caption"]])[0]
    assert 1 <= len(record["subjects"]) <= 3  # the zero-shot still derives every field
    assert "technical_quality" not in record  # but never what a caption cannot tell


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_tiny_qwen3_vl(tmp_path_factory.mktemp("models") / "tiny-qwen3-vl")


def test_structured_decoding_with_the_tiny_random_model_always_validates(tiny_model):
    decoder = backends.load_decoder(str(tiny_model))
    captions = ["A red bus in a street.", "", "A scanned invoice full of numbers."]
    for caption in captions:
        answer = decoder.decode(backends.chat_prompt(decoder.tokenizer, caption))
        record, reason = parse_record(answer)
        assert reason is None, answer
        assert validate(record) == []
    assert decoder.forwards >= len(captions) * len(fields())


def test_vllm_asks_for_the_json_schema_and_retries_with_a_seed():
    first, retry = backends.vllm_sampling_params(0), backends.vllm_sampling_params(1)
    assert json.loads(first["structured_outputs"]["json"]) == json_schema()
    assert first["temperature"] == 0.0 and "seed" not in first
    assert retry["temperature"] > 0 and retry["seed"] == 1
    settings = backends.VLLMAttributeSettings(accelerator_type="H200", concurrency=2)
    config = backends.vllm_engine(settings).processor_config()
    assert isinstance(config, vLLMEngineProcessorConfig)
    assert config.should_continue_on_error is True and config.concurrency == 2
    assert config.engine_kwargs["limit_mm_per_prompt"] == {"image": 1, "video": 0}


def test_vllm_rows_are_checked_and_errors_kept(tmp_path):
    from prx_assets.testing.images import jpeg_bytes

    row = {"id": "s:1", "caption_version": "cv", "caption": "a heron",
           "image": jpeg_bytes(64, 48)}
    request = backends.vllm_preprocess(backends.VLLMAttributeSettings())(row)
    parts = request["messages"][0]["content"]
    assert parts[0]["type"] == "image_pil" and "Caption: a heron" in parts[1]["text"]
    assert "structured_outputs" in request["sampling_params"]
    post = backends.vllm_postprocess
    assert post({**row, "generated_text": json.dumps(GOOD)})["status"] == STATUS_OK
    invalid = post({**row, "generated_text": '{"medium": "photo"}'})
    assert invalid["status"] == STATUS_INVALID and "missing 'subjects'" in invalid["error"]
    failed = post({**row, "__inference_error__": "CUDA out of memory"})
    assert failed["status"] == STATUS_FAILED and failed["error"] == "CUDA out of memory"
    tagged = backends.tagged_from_answers({
        "id": ["a", "b"], "caption_version": ["cv", "cv"],
        "answer": [json.dumps(GOOD), None], "status": [STATUS_OK, STATUS_INVALID],
        "error": [None, "missing 'style'"], "attempts": [1, 3]})
    assert tagged[0].record == GOOD and tagged[1].record is None and tagged[1].attempts == 3
    assert tagged[0].origin != ORIGIN_CAPTION
