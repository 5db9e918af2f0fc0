"""LLM backends for caption labels: `vllm` (Qwen3-8B text-only through ray.data.llm) and
`openai` (any OpenAI-compatible chat-completions endpoint, e.g. a vLLM server).

Both ask the same question and constrain the answer to exactly one label: vLLM by guided
choice (structured outputs `choice`), the endpoint by the same `structured_outputs` /
`guided_choice` request fields that vLLM's server accepts, with a strict parse of the reply
as the last line of defence (anything else is recorded as status "failed", never guessed).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from prx_assets.engine.redact import url_credentials
from prx_assets.models.openai_client import ChatReply, EndpointError, OpenAIClient
from prx_assets.models.vllm import VLLMEngine
from prx_assets.stages.labels.labels import LABELS

QUESTION = (
    "You classify images from their caption alone. Would a person mainly look at this image "
    "(a photograph, painting or scene: 'visual') or mainly read it (a document, screenshot, "
    "slide, chart or poster dominated by text: 'text')? If the caption describes sexually "
    "explicit content (sexual activity or exposed genitals), answer 'nsfw' whatever else it "
    "shows. Answer with exactly one word: visual, text or nsfw."
)
DEFAULT_LLM = "Qwen/Qwen3-8B"


def messages_for(caption: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": QUESTION},
            {"role": "user", "content": f"Caption:\n{caption}"}]


def parse_label(reply: str | None) -> str | None:
    """The label if the reply is exactly one of LABELS (case, spaces and a final full stop
    forgiven); None otherwise."""
    if reply is None:
        return None
    word = reply.strip().strip(".").strip().lower()
    return word if word in LABELS else None


def one_hot(label: str | None) -> np.ndarray:
    scores = np.zeros(len(LABELS), dtype=np.float32)
    if label is not None:
        scores[LABELS.index(label)] = 1.0
    return scores


def scores_from_top_logprobs(top: Sequence[dict[str, Any]]) -> np.ndarray | None:
    """Label probabilities from the first generated token's top log-probs, renormalised over
    the labels; None when no label appears among them."""
    probs = np.zeros(len(LABELS), dtype=np.float64)
    for entry in top:
        label = parse_label(entry.get("token"))
        if label is not None:
            probs[LABELS.index(label)] += math.exp(entry["logprob"])
    total = probs.sum()
    return (probs / total).astype(np.float32) if total > 0 else None


# --- vllm through ray.data.llm -----------------------------------------------------------

@dataclass(frozen=True)
class VLLMSettings:
    model: str = DEFAULT_LLM
    concurrency: int = 1
    batch_size: int = 256
    tensor_parallel_size: int = 1
    max_model_len: int = 4096
    accelerator_type: str | None = None
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # vLLM's, on top of ours
    # Each engine's share of its GPU; the caption embedder holds the rest of it (1.0: the
    # engine has the GPU alone and the embeddings need a GPU of their own).
    gpu_share: float = 0.9


def vllm_sampling_params() -> dict[str, Any]:
    """Greedy, one short answer, constrained to exactly one label by guided choice."""
    return {"temperature": 0.0, "max_tokens": 4, "structured_outputs": {"choice": list(LABELS)}}


def vllm_engine(settings: VLLMSettings) -> VLLMEngine:
    """The text-only vLLM stage of the labeller."""
    return VLLMEngine(
        model=settings.model,
        engine_kwargs={"max_model_len": settings.max_model_len,
                       "tensor_parallel_size": settings.tensor_parallel_size,
                       "enable_prefix_caching": True,  # the question prefix is shared
                       **settings.engine_kwargs},
        concurrency=settings.concurrency,
        batch_size=settings.batch_size,
        accelerator_type=settings.accelerator_type,
        gpu_share=settings.gpu_share,
        # Qwen3 thinks aloud unless told not to; a one-word answer needs no reasoning.
        chat_template_kwargs={"enable_thinking": False},
    )


def vllm_processor_config(settings: VLLMSettings):
    """The ray.data.llm config for the label stage (vLLM is needed only when it runs)."""
    return vllm_engine(settings).processor_config()


def vllm_preprocess(row: dict[str, Any]) -> dict[str, Any]:
    return {**row, "messages": messages_for(row["caption"] or ""),
            "sampling_params": vllm_sampling_params()}


def vllm_postprocess(row: dict[str, Any]) -> dict[str, Any]:
    label = parse_label(row.get("generated_text"))
    keep: dict[str, Any] = {k: row[k] for k in ("id", "caption_version", "embedding")
                            if k in row}
    return {**keep, "label": label, "scores": one_hot(label)}


def build_vllm_labeler(settings: VLLMSettings):
    """A ray.data.llm Processor mapping caption rows to (id, label, scores) rows."""
    return vllm_engine(settings).processor(vllm_preprocess, vllm_postprocess)


# --- OpenAI-compatible endpoint ----------------------------------------------------------

@dataclass(frozen=True)
class OpenAISettings:
    base_url: str  # e.g. http://127.0.0.1:8000/v1
    model: str = DEFAULT_LLM
    api_key: str | None = None
    concurrency: int = 8
    retries: int = 4
    backoff_s: float = 0.5
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        secret = url_credentials(self.base_url)
        if secret:  # the URL is resource config, which the Dagster UI shows
            raise ValueError(f"classifier base_url holds a credential ({secret}); put the "
                             "key in the variable `api_key_env` names instead")


@dataclass
class LabelReply:
    label: str | None
    scores: np.ndarray
    error: str | None = None
    attempts: int = 1


@dataclass
class OpenAILabelClient:
    """Labels captions through the shared endpoint client, `concurrency` requests at a
    time; a caption that still fails after its retries gets a LabelReply with an error, not
    an exception."""

    settings: OpenAISettings
    _sleep: Any = field(default=time.sleep, repr=False)

    def __post_init__(self) -> None:
        s = self.settings
        self.client = OpenAIClient(s.base_url, api_key=s.api_key, timeout_s=s.timeout_s,
                                   max_retries=s.retries, backoff_s=s.backoff_s,
                                   sleep=self._sleep)

    def label(self, captions: Sequence[str]) -> list[LabelReply]:
        with ThreadPoolExecutor(max_workers=max(1, self.settings.concurrency)) as pool:
            return list(pool.map(self.label_one, captions))

    def label_one(self, caption: str) -> LabelReply:
        try:
            reply = self.client.complete(self._payload(caption))
        except EndpointError as err:
            return LabelReply(None, one_hot(None), str(err), err.attempts)
        return _label_reply(reply)

    def _payload(self, caption: str) -> dict[str, Any]:
        return {
            "model": self.settings.model, "messages": messages_for(caption),
            "temperature": 0.0, "max_tokens": 4, "logprobs": True, "top_logprobs": 5,
            # vLLM's server: newer releases read structured_outputs, older guided_choice.
            "structured_outputs": {"choice": list(LABELS)}, "guided_choice": list(LABELS),
            "chat_template_kwargs": {"enable_thinking": False},
        }


def _label_reply(reply: ChatReply) -> LabelReply:
    label = parse_label(reply.content)
    if label is None:
        return LabelReply(None, one_hot(None), f"not a label: {reply.content!r}"[:200],
                          reply.attempts)
    content = ((reply.choice.get("logprobs") or {}).get("content") or [])
    scores = scores_from_top_logprobs(content[0].get("top_logprobs", [])) if content else None
    return LabelReply(label, scores if scores is not None else one_hot(label), None,
                      reply.attempts)
