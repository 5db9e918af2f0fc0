"""Model backends of the attribute tagger, both constrained to the JSON schema.

- `vllm` (production): the captioning VLM looks at the image (its caption as context) under
  vLLM's structured-output decoding, `sampling_params["structured_outputs"] = {"json":
  <schema>}` through `ray.data.llm`. An answer that still does not validate (cut short by
  max_tokens, an engine without the grammar backend) is asked again with a fresh seed, up to
  `retries` times, then recorded with the reason; an engine error is recorded as `failed`
  (retried on the next run). Nothing raises out of a partition.
- `transformers` (local weights, the tests' tiny random model): `StructuredDecoder` writes
  the record field by field, scoring only the values the schema allows at each step, so
  every answer is valid JSON of the schema by construction; it is validated all the same.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prx_assets.models.vllm import INFERENCE_ERROR, VLLMEngine
from prx_assets.stages.attributes.schema import (
    ORIGIN_MODEL,
    SCHEMA_VERSION,
    STATUS_FAILED,
    STATUS_INVALID,
    STATUS_OK,
    Field,
    Tagged,
    fields,
    parse_record,
    schema_text,
)

if TYPE_CHECKING:
    import ray.data

INSTRUCTIONS = (
    "Tag this image with structured attributes for a dataset curator. Report only what is "
    "visible. Answer with one JSON object with these fields: medium, subjects (1-3), people, "
    "visible_text, watermark, setting, lighting, composition, style, technical_quality and "
    "aesthetic_quality (1 poor to 5 excellent)."
)
MAX_CAPTION_CHARS = 1200  # the caption is context, not the task: a long one is cut


def user_text(caption: str | None) -> str:
    caption = (caption or "").strip()[:MAX_CAPTION_CHARS]
    return f"{INSTRUCTIONS}\nCaption: {caption}" if caption else INSTRUCTIONS


# --- vLLM through ray.data.llm -------------------------------------------------------------

@dataclass(frozen=True)
class VLLMAttributeSettings:
    model: str = "Qwen/Qwen3-VL-8B-Instruct"
    concurrency: int = 1
    batch_size: int = 64
    max_tokens: int = 256  # a record is ~80 tokens; room for long subject names
    retries: int = 2  # further attempts of an answer that does not validate
    image_budget: int = 448 * 448
    accelerator_type: str | None = None
    engine_kwargs: dict[str, Any] = field(default_factory=dict)


def vllm_sampling_params(attempt: int = 0, version: str = SCHEMA_VERSION) -> dict[str, Any]:
    """Greedy on the first attempt; a retry samples with a seed of its own (greedy would
    repeat the same answer). The JSON schema constrains every token either way."""
    sampling: dict[str, Any] = {"temperature": 0.0 if attempt == 0 else 0.7,
                                "max_tokens": VLLMAttributeSettings.max_tokens,
                                # As text: a nested dict in a Ray Data row goes through
                                # Arrow, which would give every property every other's keys
                                # (as nulls); vLLM takes the schema as a string too.
                                "structured_outputs": {"json": schema_text(version)}}
    if attempt:
        sampling["seed"] = attempt
    return sampling


def vllm_engine(settings: VLLMAttributeSettings) -> VLLMEngine:
    """The multimodal stage: one image per prompt (no video), errors kept per row."""
    return VLLMEngine(
        model=settings.model,
        engine_kwargs={"max_model_len": 8192, "limit_mm_per_prompt": {"image": 1, "video": 0},
                       **settings.engine_kwargs},
        batch_size=settings.batch_size, concurrency=settings.concurrency,
        accelerator_type=settings.accelerator_type, continue_on_error=True, images=True)


def vllm_preprocess(settings: VLLMAttributeSettings, attempt: int = 0
                    ) -> Callable[[dict], dict]:
    from prx_assets.stages.captions.captioners import model_image

    sampling = vllm_sampling_params(attempt)

    def preprocess(row: dict) -> dict:
        image = model_image(row["image"], settings.image_budget)
        content = [{"type": "image_pil", "image_pil": image},
                   {"type": "text", "text": user_text(row.get("caption"))}]
        return {"id": row["id"], "caption_version": row["caption_version"],
                "caption": row.get("caption"), "image": row["image"],
                "messages": [{"role": "user", "content": content}],
                "sampling_params": sampling}

    return preprocess


def vllm_postprocess(row: dict) -> dict:
    """The answer checked against the schema: `answer` is the JSON text when it validates,
    else `error` says why (an engine error, or what broke the schema)."""
    error = row.get(INFERENCE_ERROR) or None
    keep = {k: row.get(k) for k in ("id", "caption_version", "caption", "image")}
    if error:
        return {**keep, "answer": None, "status": STATUS_FAILED, "error": str(error)[:500]}
    record, reason = parse_record(row.get("generated_text"))
    if record is None:
        return {**keep, "answer": None, "status": STATUS_INVALID, "error": reason}
    return {**keep, "answer": json.dumps(record), "status": STATUS_OK, "error": None}


def vllm_attempt(requests: ray.data.Dataset, settings: VLLMAttributeSettings, attempt: int
                 ) -> ray.data.Dataset:
    processor = vllm_engine(settings).processor(vllm_preprocess(settings, attempt),
                                                vllm_postprocess)
    return processor(requests)


def vllm_tagged(requests: ray.data.Dataset, settings: VLLMAttributeSettings
                ) -> ray.data.Dataset:
    """Rows {id, caption_version, answer, status, error, attempts}: invalid answers asked
    again up to `settings.retries` times (each retry runs over the invalid rows only)."""
    answered = vllm_attempt(requests, settings, 0).materialize()
    done = answered.filter(expr=f"status != '{STATUS_INVALID}'").add_column(
        "attempts", lambda batch: [1] * len(batch), batch_format="pyarrow")
    for attempt in range(1, settings.retries + 1):
        invalid = answered.filter(expr=f"status = '{STATUS_INVALID}'")
        if invalid.count() == 0:
            break
        answered = vllm_attempt(invalid.select_columns(
            ["id", "caption_version", "caption", "image"]), settings, attempt).materialize()
        n = attempt + 1
        done = done.union(answered.filter(expr=f"status != '{STATUS_INVALID}'").add_column(
            "attempts", lambda batch, n=n: [n] * len(batch), batch_format="pyarrow"))
    else:
        attempt = settings.retries
    final = settings.retries + 1
    rest = answered.filter(expr=f"status = '{STATUS_INVALID}'").add_column(
        "attempts", lambda batch: [final] * len(batch), batch_format="pyarrow")
    columns = ["id", "caption_version", "answer", "status", "error", "attempts"]
    return done.union(rest).select_columns(columns)


def tagged_from_answers(rows: dict[str, Sequence[Any]]) -> list[Tagged]:
    """The vLLM stage's rows as `Tagged` outcomes."""
    return [Tagged(id=i, caption_version=cv, record=json.loads(a) if a else None, status=s,
                   origin=ORIGIN_MODEL, error=e, attempts=int(n))
            for i, cv, a, s, e, n in zip(rows["id"], rows["caption_version"], rows["answer"],
                                         rows["status"], rows["error"], rows["attempts"],
                                         strict=True)]


# --- structured decoding with local weights ------------------------------------------------

class StructuredDecoder:
    """Greedy decoding constrained to the schema with a transformers causal LM.

    The record is written in the schema's field order; at each value the model scores every
    continuation the schema allows there (each enum value, each integer, true/false, for a
    list the next item or its end) by the summed log-probability of its tokens, and the best
    one is written. The output is therefore always one JSON object of the schema: what the
    model decides is which allowed value, which is what structured decoding guarantees too.
    """

    def __init__(self, model: Any, tokenizer: Any, version: str = SCHEMA_VERSION):
        import torch

        self.torch = torch
        self.model = model
        self.tokenizer = tokenizer
        self.fields = fields(version)
        self.forwards = 0  # model calls made (a benchmark's unit of work)

    def tokens(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, prompt: str) -> str:
        """The JSON text of one record for a prompt (already chat-formatted)."""
        draft = _Draft(self, self.tokens(prompt))
        draft.write("{")
        for i, f in enumerate(self.fields):
            draft.write(("" if i == 0 else ", ") + json.dumps(f.name) + ": ")
            if f.kind == "enum_list":
                self._write_list(f, draft)
            else:
                draft.write(self.choose(draft.ids, [json.dumps(v) for v in f.values]))
        draft.write("}")
        return "".join(draft.text)

    def _write_list(self, f: Field, draft: _Draft) -> None:
        draft.write("[")
        chosen: list[str] = []
        while True:
            remaining = [json.dumps(v) for v in f.values if json.dumps(v) not in chosen]
            if not chosen:
                options = remaining
            elif len(chosen) >= f.max_items:
                options = ["]"]
            else:
                options = ["]", *(", " + o for o in remaining)]
            pick = self.choose(draft.ids, options)
            draft.write(pick)
            if pick == "]":
                return
            chosen.append(pick.removeprefix(", "))

    def choose(self, prefix: list[int], options: Sequence[str]) -> str:
        """The option whose tokens have the highest summed log-probability after `prefix`."""
        torch = self.torch
        continuations = [self.tokens(o) for o in options]
        longest = max(len(c) for c in continuations)
        pad = self.tokenizer.pad_token_id or 0
        rows = [prefix + c + [pad] * (longest - len(c)) for c in continuations]
        mask = [[1] * (len(prefix) + len(c)) + [0] * (longest - len(c)) for c in continuations]
        with torch.inference_mode():
            logits = self.model(input_ids=torch.tensor(rows),
                                attention_mask=torch.tensor(mask)).logits
        self.forwards += 1
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        scores = []
        for j, c in enumerate(continuations):
            positions = range(len(prefix) - 1, len(prefix) - 1 + len(c))
            scores.append(sum(float(logprobs[j, p, t]) for p, t in zip(positions, c,
                                                                       strict=True)))
        return options[max(range(len(options)), key=scores.__getitem__)]


@dataclass
class _Draft:
    """The answer being written: its text and the prompt's and its tokens so far."""

    decoder: StructuredDecoder
    ids: list[int]
    text: list[str] = field(default_factory=list)

    def write(self, piece: str) -> None:
        self.ids = self.ids + self.decoder.tokens(piece)
        self.text.append(piece)


def load_decoder(model_path: str, threads: int = 1) -> StructuredDecoder:
    """A decoder over local weights (a folder; nothing is downloaded)."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    torch.set_num_threads(max(1, threads))
    tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    model = AutoModelForImageTextToText.from_pretrained(model_path, local_files_only=True,
                                                        dtype=torch.float32).eval()
    return StructuredDecoder(model, tokenizer)


def chat_prompt(tokenizer: Any, caption: str | None) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": user_text(caption)}],
                                         add_generation_prompt=True, tokenize=False)
