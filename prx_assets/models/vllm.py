"""One builder of vLLM stages through Ray Data (`ray.data.llm`).

Captioning (Qwen3-VL, images) and labelling (Qwen3, text only) run vLLM the same way: a
`vLLMEngineProcessorConfig` (model, engine arguments, replicas, batch size, accelerator)
turned into a Ray Data processor by `build_processor`, with a row-level preprocess that
writes `messages` and `sampling_params` and a postprocess that reads `generated_text`.
What differs between them is data, held by `VLLMEngine`: whether the multimodal preparation
stage runs (images passed as PIL in the messages), chat-template arguments, and whether a
failed row is kept with its error or fails the run. vLLM itself is imported only when the
processor runs; the configuration builds wherever Ray is installed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ray.data.llm import Processor, vLLMEngineProcessorConfig

RowFn = Callable[[dict[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class VLLMEngine:
    """A vLLM stage: which model, how it is served, and which preparation stages run."""

    model: str  # HF id or local folder
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # vLLM engine arguments
    batch_size: int = 64  # rows per request batch sent to an engine replica
    concurrency: int = 1  # engine replicas
    accelerator_type: str | None = None  # e.g. "H200"
    # True: a row whose inference fails comes back with `__inference_error__` set;
    # False: it fails the run.
    continue_on_error: bool = False
    images: bool = False  # run the multimodal preparation stage (image parts in messages)
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": False}

    def processor_config(self) -> vLLMEngineProcessorConfig:
        """The `ray.data.llm` configuration of this stage."""
        from ray.data.llm import (
            ChatTemplateStageConfig,
            PrepareMultimodalStageConfig,
            vLLMEngineProcessorConfig,
        )

        chat_template: Any = True
        if self.chat_template_kwargs:
            chat_template = ChatTemplateStageConfig(
                chat_template_kwargs=dict(self.chat_template_kwargs))
        multimodal: Any = False
        if self.images:
            # "openai" content format: image parts stay structured for the processor.
            multimodal = PrepareMultimodalStageConfig(
                enabled=True, chat_template_content_format="openai")
        return vLLMEngineProcessorConfig(
            model_source=self.model,
            engine_kwargs=dict(self.engine_kwargs),
            batch_size=self.batch_size,
            concurrency=self.concurrency,
            accelerator_type=self.accelerator_type,
            should_continue_on_error=self.continue_on_error,
            chat_template_stage=chat_template,
            tokenize_stage=True,
            detokenize_stage=True,
            prepare_multimodal_stage=multimodal,
        )

    def processor(self, preprocess: RowFn, postprocess: RowFn) -> Processor:
        """A Ray Data processor: dataset of input rows in, dataset of postprocessed rows out."""
        from ray.data.llm import build_processor

        return build_processor(self.processor_config(), preprocess=preprocess,
                               postprocess=postprocess)
