import inspect

import numpy as np
import pytest
from ray.data.llm import vLLMEngineProcessorConfig
from ray.llm._internal.batch.stages import vllm_engine_stage

from prx_assets.stages.labels.backends import (
    DEFAULT_LLM,
    OpenAILabelClient,
    OpenAISettings,
    VLLMSettings,
    parse_label,
    scores_from_top_logprobs,
    vllm_postprocess,
    vllm_preprocess,
    vllm_processor_config,
)
from prx_assets.stages.labels.labels import LABELS
from prx_assets.stages.labels.runs import LabelerSpec
from prx_assets.testing.local_chat_server import chat_server


def test_vllm_config_builds_against_the_installed_ray_data_llm():
    config = vllm_processor_config(VLLMSettings(concurrency=2, batch_size=128))
    assert isinstance(config, vLLMEngineProcessorConfig)
    assert config.model_source == DEFAULT_LLM == "Qwen/Qwen3-8B"
    assert (config.concurrency, config.batch_size) == (2, 128)
    assert config.engine_kwargs["task_type"] == "generate"
    assert config.chat_template_stage.chat_template_kwargs == {"enable_thinking": False}
    # Engine arguments of the settings go on top of the stage's own (the GPU bench's random
    # weights, a memory share).
    dummy = vllm_processor_config(VLLMSettings(engine_kwargs={"load_format": "dummy",
                                                              "max_model_len": 2048}))
    assert dummy.engine_kwargs["load_format"] == "dummy"
    assert dummy.engine_kwargs["max_model_len"] == 2048
    assert dummy.engine_kwargs["enable_prefix_caching"] is True
    # The row carries guided choice in the key the installed vLLM stage turns into
    # StructuredOutputsParams: exactly one of the three labels can come out.
    row = vllm_preprocess({"id": "a", "caption_version": "v", "caption": "A red barn."})
    assert row["sampling_params"]["structured_outputs"] == {"choice": list(LABELS)}
    assert row["sampling_params"]["temperature"] == 0.0
    assert row["messages"][-1]["content"].endswith("A red barn.")
    assert 'sampling_params.pop("structured_outputs")' in inspect.getsource(vllm_engine_stage)
    out = vllm_postprocess({**row, "generated_text": "text", "embedding": [0.0]})
    assert out["label"] == "text" and out["scores"].tolist() == [0.0, 1.0, 0.0]
    assert vllm_postprocess({**row, "generated_text": "a barn"})["label"] is None


def test_parse_label_is_strict():
    assert [parse_label(t) for t in ("visual", " Text.", "NSFW\n")] == ["visual", "text", "nsfw"]
    assert [parse_label(t) for t in ("visually", "text or visual", "", None)] == [None] * 4
    scores = scores_from_top_logprobs([{"token": "text", "logprob": np.log(0.6)},
                                       {"token": "visual", "logprob": np.log(0.2)},
                                       {"token": "hmm", "logprob": np.log(0.2)}])
    assert np.allclose(scores, [0.25, 0.75, 0.0])
    assert scores_from_top_logprobs([{"token": "hmm", "logprob": 0.0}]) is None


def test_versions_differ_per_backend_and_model():
    versions = {LabelerSpec().version(), LabelerSpec("vllm").version(),
                LabelerSpec("openai", openai=OpenAISettings("http://x/v1")).version(),
                LabelerSpec("openai", openai=OpenAISettings("http://x/v1", model="m")).version()}
    assert len(versions) == 4
    with pytest.raises(ValueError, match="unknown classifier backend"):
        LabelerSpec("magic")


def test_openai_client_labels_concurrently_with_retries_against_a_local_server():
    captions = ["A screenshot of a settings page.", "A nude adult couple, explicit.",
                "A flaky photo of a lake at dawn.", "Some gibberish caption.",
                "A dog on a porch."] + [f"A field of poppies, number {i}." for i in range(8)]
    sleeps: list[float] = []
    with chat_server() as (url, state):
        state.failures_left = {"flaky": 2}
        client = OpenAILabelClient(OpenAISettings(url, concurrency=4, retries=3,
                                                  backoff_s=0.01), _sleep=sleeps.append)
        replies = client.label(captions)
    assert [r.label for r in replies[:5]] == ["text", "nsfw", "visual", None, "visual"]
    assert replies[2].attempts == 3 and sleeps == [0.01, 0.02]  # exponential backoff
    assert "not a label" in replies[3].error
    assert replies[0].scores.argmax() == LABELS.index("text") and replies[0].scores.sum() == 1
    assert state.max_in_flight > 1  # requests really overlap
    sent = state.requests[0]
    assert sent["structured_outputs"] == {"choice": list(LABELS)}
    assert sent["guided_choice"] == list(LABELS) and sent["temperature"] == 0.0


def test_openai_client_reports_errors_without_raising():
    with chat_server() as (url, state):
        state.failures_left = {"lake": 10}
        client = OpenAILabelClient(OpenAISettings(url, retries=1, backoff_s=0.0))
        gave_up = client.label_one("A lake.")
        wrong_path = OpenAILabelClient(OpenAISettings(url + "/nope")).label_one("A lake.")
    assert gave_up.label is None and "gave up" in gave_up.error and gave_up.attempts == 2
    assert wrong_path.label is None and "HTTP 404" in wrong_path.error
    closed = OpenAILabelClient(OpenAISettings("http://127.0.0.1:9/v1", retries=0)).label_one("x")
    assert closed.label is None and closed.error
