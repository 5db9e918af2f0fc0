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
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from ray.data.llm import Processor, vLLMEngineProcessorConfig

RowFn = Callable[[dict[str, Any]], dict[str, Any]]
INFERENCE_ERROR = "__inference_error__"  # Ray's column: the error of a failed row, else ""


@dataclass(frozen=True)
class VLLMEngine:
    """A vLLM stage: which model, how it is served, and which preparation stages run."""

    model: str  # HF id or local folder
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # vLLM engine arguments
    batch_size: int = 64  # rows per request batch sent to an engine replica
    concurrency: int = 1  # engine replicas
    accelerator_type: str | None = None  # e.g. "H200"
    # True: a row whose inference fails is postprocessed like the others, with
    # `__inference_error__` set (`postprocess_failed_rows`); False: it fails the run.
    continue_on_error: bool = False
    images: bool = False  # run the multimodal preparation stage (image parts in messages)
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": False}
    # Each engine worker's share of its GPU. Below 1, another Ray actor can hold the rest of
    # the same GPU (the labeller's caption embedder takes 1 - share).
    gpu_share: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.gpu_share <= 1:
            raise ValueError(f"gpu_share is a share of one GPU, in (0, 1]: {self.gpu_share}")

    def placement(self) -> dict[str, Any] | None:
        """Ray's placement group for one replica: None (ray.data.llm's default, a whole GPU
        per worker) or one bundle per worker holding `gpu_share` of a GPU."""
        if self.gpu_share == 1:
            return None
        return {"bundle_per_worker": {"CPU": 1, "GPU": self.gpu_share}, "strategy": "PACK"}

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
            placement_group_config=self.placement(),
        )

    def processor(self, preprocess: RowFn, postprocess: RowFn) -> Processor:
        """A Ray Data processor: dataset of input rows in, dataset of postprocessed rows out."""
        from ray.data.llm import build_processor

        processor = build_processor(self.processor_config(), preprocess=preprocess,
                                    postprocess=postprocess)
        if self.continue_on_error:
            postprocess_failed_rows(processor, postprocess)
        return processor


def postprocess_failed_rows(processor: Processor, postprocess: RowFn) -> None:
    """Send the rows whose inference failed through `postprocess` too.

    Ray's processor hands a failed row back whole, without calling `postprocess`: every
    column its stages made (the image, the prompt, the tokens) and none of the postprocessed
    ones. Captioning then read it as an answer with no text, a final status that is never
    retried, and the error itself was lost. Here a failed row is postprocessed like the
    others (the postprocess reads `__inference_error__`), and keeps that column, which Ray
    sets to "" on every other row.
    """
    wrapped = cast(RowFn, processor.postprocess)  # Ray wraps even an absent postprocess

    def every_row(row: dict[str, Any]) -> dict[str, Any]:
        out = wrapped(row)
        error = out.get(INFERENCE_ERROR) or ""
        return {**postprocess(out), INFERENCE_ERROR: error} if error else out

    processor.postprocess = every_row
