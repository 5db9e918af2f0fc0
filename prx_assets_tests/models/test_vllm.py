"""The one vLLM stage builder, checked as configuration against the installed ray.data.llm
(no vLLM on this machine: the processor itself is built with build_processor stubbed)."""

import pytest
import ray.data.llm
from ray.data.llm import (
    ChatTemplateStageConfig,
    PrepareMultimodalStageConfig,
    vLLMEngineProcessorConfig,
)

from prx_assets.models.vllm import VLLMEngine


def _stage(config, name, cls):
    """A stage setting as its config class (the installed Ray keeps a bool or dict as given)."""
    value = getattr(config, name)
    if isinstance(value, bool):
        return cls(enabled=value)
    return cls.model_validate(value) if isinstance(value, dict) else value


def test_a_text_engine_gets_chat_template_arguments_and_no_image_stage():
    config = VLLMEngine("Qwen/Qwen3-8B", engine_kwargs={"max_model_len": 4096},
                        batch_size=128, concurrency=2,
                        chat_template_kwargs={"enable_thinking": False}).processor_config()
    assert isinstance(config, vLLMEngineProcessorConfig)
    assert (config.model_source, config.batch_size, config.concurrency) == \
        ("Qwen/Qwen3-8B", 128, 2)
    assert config.engine_kwargs == {"max_model_len": 4096, "task_type": "generate"}
    assert config.should_continue_on_error is False  # a label failure fails the run
    template = _stage(config, "chat_template_stage", ChatTemplateStageConfig)
    assert template.chat_template_kwargs == {"enable_thinking": False}
    assert not _stage(config, "prepare_multimodal_stage", PrepareMultimodalStageConfig).enabled


def test_an_image_engine_prepares_multimodal_messages_and_keeps_failed_rows():
    kwargs = {"limit_mm_per_prompt": {"image": 1}}
    engine = VLLMEngine("Qwen/Qwen3-VL-8B-Instruct", engine_kwargs=kwargs,
                        accelerator_type="H200", continue_on_error=True, images=True)
    config = engine.processor_config()
    stage = _stage(config, "prepare_multimodal_stage", PrepareMultimodalStageConfig)
    assert stage.enabled and stage.chat_template_content_format == "openai"
    assert config.accelerator_type == "H200" and config.should_continue_on_error is True
    assert kwargs == {"limit_mm_per_prompt": {"image": 1}}  # the caller's dict is not touched


def test_processor_hands_the_config_and_row_functions_to_build_processor(monkeypatch):
    calls = {}

    def fake_build_processor(config, preprocess=None, postprocess=None):
        calls.update(config=config, preprocess=preprocess, postprocess=postprocess)
        return "processor"

    monkeypatch.setattr(ray.data.llm, "build_processor", fake_build_processor)
    pre, post = (lambda row: row), (lambda row: row)
    assert VLLMEngine("m").processor(pre, post) == "processor"
    assert isinstance(calls["config"], vLLMEngineProcessorConfig)
    assert (calls["preprocess"], calls["postprocess"]) == (pre, post)


def test_a_failed_row_goes_through_postprocess_like_the_others():
    """Ray's processor hands a failed row back whole, past the postprocess; with
    continue_on_error the row is postprocessed too, so every row has the same columns and
    the caller sees the error (captioning recorded such a row as an empty answer before)."""
    from ray.llm._internal.batch.processor.base import Processor

    from prx_assets.models.vllm import INFERENCE_ERROR, postprocess_failed_rows
    from prx_assets.stages.captions.captioners import vllm_postprocess

    config = VLLMEngine("m", continue_on_error=True).processor_config()
    data = Processor.DATA_COLUMN
    ok = {"id": "a", "image": b"jpeg", "generated_text": "A red barn."}
    failed = {"id": "b", "image": b"jpeg", "prompt": "...", "generated_text": "",
              INFERENCE_ERROR: "ValueError: prompt too long"}
    as_ray = Processor(config, [], postprocess=vllm_postprocess)
    assert as_ray.postprocess({data: dict(failed)}) == failed  # the installed Ray's behaviour
    postprocess_failed_rows(as_ray, vllm_postprocess)
    assert as_ray.postprocess({data: dict(ok)}) == \
        {"id": "a", "raw": "A red barn.", "error": None, INFERENCE_ERROR: ""}
    assert as_ray.postprocess({data: dict(failed)}) == \
        {"id": "b", "raw": None, "error": "ValueError: prompt too long",
         INFERENCE_ERROR: "ValueError: prompt too long"}


def test_only_an_engine_that_keeps_failed_rows_wraps_its_postprocess(monkeypatch):
    class Built:
        postprocess = staticmethod(lambda row: row)

    monkeypatch.setattr(ray.data.llm, "build_processor", lambda config, **_: Built())
    def post(row: dict) -> dict:
        return row

    assert VLLMEngine("m").processor(post, post).postprocess is Built.postprocess
    wrapped = VLLMEngine("m", continue_on_error=True).processor(post, post).postprocess
    assert wrapped is not Built.postprocess


def test_an_engine_below_a_whole_gpu_asks_ray_for_its_share_in_its_placement_group():
    whole = VLLMEngine("Qwen/Qwen3-8B").processor_config()
    assert whole.placement_group_config is None  # ray.data.llm's default: a GPU per worker
    shared = VLLMEngine("Qwen/Qwen3-8B", gpu_share=0.9).processor_config()
    assert shared.placement_group_config["bundle_per_worker"] == {"CPU": 1, "GPU": 0.9}
    for share in (0.0, 1.5):
        with pytest.raises(ValueError, match="gpu_share"):
            VLLMEngine("Qwen/Qwen3-8B", gpu_share=share)
