"""Captioning backends as Ray Data stages.

Every backend turns rows `{id, image (bucketed JPEG bytes), original_caption}` into rows
`{id, raw, error}`; `finish_captions` then cleans the text and stamps version, model and
time. Backends:

- `original`: no model, the source's own caption;
- `transformers`: local weights in a Ray actor pool (CPU or GPU);
- `openai`: an OpenAI-compatible chat endpoint, concurrent requests with retries;
- `vllm`: production, through `ray.data.llm` (vLLMEngineProcessorConfig + build_processor)
  with the multimodal preparation stage, images passed as PIL.
"""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
from PIL import Image

from prx_assets.engine.batches import batch_fn
from prx_assets.engine.redact import redact, url_credentials
from prx_assets.models.openai_client import EndpointError, OpenAIClient
from prx_assets.models.vllm import VLLMEngine
from prx_assets.stages.captions.captions import (
    CAPTIONS_SCHEMA,
    DEFAULT_PROMPT,
    STATUS_EMPTY,
    STATUS_FAILED,
    caption_version,
    clean_caption,
    load_prompt,
)

if TYPE_CHECKING:
    import ray.data

BACKENDS = ("original", "transformers", "openai", "vllm")
USER_TEXT = "Write the caption for this image."


@dataclass(frozen=True)
class CaptionerSpec:
    """Everything a captioning run needs; the fields that change captions go in the version."""

    backend: str = "original"
    model: str = ""  # HF id (vllm, openai) or local folder (transformers)
    prompt_name: str = DEFAULT_PROMPT
    max_tokens: int = 320
    temperature: float = 0.2
    top_p: float = 0.9
    repetition_penalty: float = 1.05
    # Benchmarks: every caption exactly max_tokens long, end of sequence ignored, so that
    # throughput compares across models and runs (a random-weight model never stops alone).
    fixed_length: bool = False
    image_budget: int = 448 * 448  # pixels of the image sent to the model
    seed: int = 0
    batch_size: int = 16
    concurrency: int = 1  # model replicas / HTTP client actors
    num_gpus: float = 0.0  # per transformers actor
    cpus_per_actor: float = 1.0
    engine_kwargs: dict = field(default_factory=dict)  # vllm
    accelerator_type: str | None = None  # vllm, e.g. "H200"
    continue_on_error: bool = True
    endpoint: str = ""  # openai: base URL, e.g. http://127.0.0.1:8000/v1
    api_key: str = ""
    request_concurrency: int = 8  # openai: requests in flight per client actor
    timeout_s: float = 120.0
    max_retries: int = 4
    backoff_s: float = 1.0

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"captioner backend {self.backend!r}: expected one of {BACKENDS}")
        if self.backend != "original" and not self.model:
            raise ValueError(f"captioner backend {self.backend!r} needs a model")
        if self.backend == "openai" and not self.endpoint:
            raise ValueError("captioner backend 'openai' needs an endpoint URL")
        secret = url_credentials(self.endpoint)
        if secret:  # the endpoint is resource config, which the Dagster UI shows
            raise ValueError(f"captioner endpoint holds a credential ({secret}); keep it out "
                             "of the config: put the key in the variable `api_key_env` "
                             "names (default OPENAI_API_KEY)")

    @property
    def uses_model(self) -> bool:
        return self.backend != "original"

    @property
    def model_name(self) -> str:
        return self.model if self.uses_model else "source caption"

    def sampling(self) -> dict:
        if not self.uses_model:
            return {}
        sampling = {"max_tokens": self.max_tokens, "temperature": self.temperature,
                    "top_p": self.top_p, "repetition_penalty": self.repetition_penalty,
                    "seed": self.seed}
        if self.fixed_length:  # vLLM's and its server's name; transformers: min_new_tokens
            sampling["ignore_eos"] = True
        return sampling

    def prompt(self) -> str:
        return load_prompt(self.prompt_name) if self.uses_model else ""

    def version(self) -> str:
        return caption_version(self.backend, self.model_name, self.prompt(), self.sampling(),
                               self.image_budget if self.uses_model else 0)


# --- the image the model sees ---------------------------------------------------------------

def model_image(jpeg: bytes, pixel_budget: int) -> Image.Image:
    """The bucketed JPEG scaled down to at most `pixel_budget` pixels (never up)."""
    img: Image.Image = Image.open(io.BytesIO(jpeg))
    scale = min(1.0, math.sqrt(pixel_budget / (img.width * img.height)))
    size = (max(1, round(img.width * scale)), max(1, round(img.height * scale)))
    img.draft("RGB", size)  # DCT-domain downscale while decoding
    img = img.convert("RGB")
    if img.size != size:
        img = img.resize(size, Image.Resampling.BICUBIC, reducing_gap=2.0)
    return img


def chat_messages(prompt: str, image: Any, image_part: str = "image") -> list[dict]:
    """System prompt plus one user turn holding the image and the instruction."""
    part = {"type": "image", "image": image} if image_part == "image" else image
    return [{"role": "system", "content": prompt},
            {"role": "user", "content": [part, {"type": "text", "text": USER_TEXT}]}]


# --- results ------------------------------------------------------------------------------

def finish_captions(batch: pa.Table, spec: CaptionerSpec, version: str) -> pa.Table:
    """Rows {id, raw, error} to CAPTIONS_SCHEMA rows."""
    now = datetime.now(UTC)
    rows: dict[str, list[Any]] = {name: [] for name in CAPTIONS_SCHEMA.names}
    for row in batch.select(["id", "raw", "error"]).to_pylist():
        caption: str | None
        error: str | None
        if row["error"]:
            caption, status, error = None, STATUS_FAILED, redact(str(row["error"]))[:2000]
        else:
            clean = clean_caption(row["raw"])
            caption, status, error = clean.caption or None, clean.status, clean.error
            if not spec.uses_model and status == STATUS_EMPTY:
                error = "the source has no caption for this image"
        rows["id"].append(row["id"])
        rows["caption"].append(caption)
        rows["n_words"].append(len(caption.split()) if caption else 0)
        rows["status"].append(status)
        rows["error"].append(error)
    n = len(rows["id"])
    rows.update(caption_version=[version] * n, model=[spec.model_name] * n,
                backend=[spec.backend] * n, created_at=[now] * n)
    return pa.Table.from_pydict(rows, schema=CAPTIONS_SCHEMA)


def _result(ids, raws, errors) -> dict:
    return {"id": list(ids), "raw": list(raws), "error": list(errors)}


# --- backend: original --------------------------------------------------------------------

def original_captions(batch: pa.Table) -> pa.Table:
    ids = batch.column("id")
    raw = batch.column("original_caption") if "original_caption" in batch.column_names \
        else pa.nulls(len(batch), pa.string())
    return pa.table({"id": ids, "raw": raw.cast(pa.string()),
                     "error": pa.nulls(len(batch), pa.string())})


# --- backend: transformers ----------------------------------------------------------------

class TransformersCaptioner:
    """A Ray actor holding local weights; generates for a batch, isolating bad rows."""

    def __init__(self, spec: CaptionerSpec):
        import torch
        from transformers import AutoModelForImageTextToText, AutoProcessor

        self.spec = spec
        self.torch = torch
        self.device = "cuda" if spec.num_gpus > 0 and torch.cuda.is_available() else "cpu"
        if self.device == "cpu":
            torch.set_num_threads(max(1, int(spec.cpus_per_actor)))
        dtype = torch.bfloat16 if self.device == "cuda" else torch.float32
        self.processor = AutoProcessor.from_pretrained(spec.model)
        self.processor.tokenizer.padding_side = "left"  # decoder-only batching
        self.model = AutoModelForImageTextToText.from_pretrained(
            spec.model, dtype=dtype).to(self.device).eval()
        self.prompt = spec.prompt()

    def __call__(self, batch: dict[str, np.ndarray]) -> dict:
        ids = list(batch["id"])
        images: list[Image.Image | None] = []
        errors: list[str | None] = []
        for jpeg in batch["image"]:
            try:
                images.append(model_image(jpeg, self.spec.image_budget))
                errors.append(None)
            except Exception as exc:  # a bad image fails its row, not the batch
                images.append(None)
                errors.append(f"image: {type(exc).__name__}: {exc}")
        raws: list[str | None] = [None] * len(ids)
        good = {i: img for i, img in enumerate(images) if img is not None}
        try:
            for i, text in zip(good, self.generate(list(good.values())), strict=True):
                raws[i] = text
        except Exception:  # find the row that broke the batch; the others still get captions
            for i, img in good.items():
                try:
                    raws[i] = self.generate([img])[0]
                except Exception as exc:
                    errors[i] = f"generate: {type(exc).__name__}: {exc}"
        return _result(ids, raws, errors)

    def generate(self, images: list[Image.Image]) -> list[str]:
        if not images:
            return []
        texts = [self.processor.apply_chat_template(chat_messages(self.prompt, img),
                                                    add_generation_prompt=True, tokenize=False)
                 for img in images]
        inputs = self.processor(text=texts, images=images, return_tensors="pt",
                                padding=True).to(self.device)
        self.torch.manual_seed(self.spec.seed)
        sampling = self.spec.temperature > 0
        length = {"min_new_tokens": self.spec.max_tokens} if self.spec.fixed_length else {}
        with self.torch.inference_mode():
            out = self.model.generate(
                **inputs, max_new_tokens=self.spec.max_tokens, do_sample=sampling,
                temperature=self.spec.temperature if sampling else None,
                top_p=self.spec.top_p if sampling else None,
                repetition_penalty=self.spec.repetition_penalty, **length)
        new_tokens = out[:, inputs["input_ids"].shape[1]:]
        return self.processor.batch_decode(new_tokens, skip_special_tokens=True)


# --- backend: openai-compatible endpoint --------------------------------------------------

class OpenAICaptioner:
    """Concurrent chat-completions requests through the shared endpoint client (exponential
    backoff with jitter: many actors retry a busy server out of step)."""

    def __init__(self, spec: CaptionerSpec):
        self.spec = spec
        self.prompt = spec.prompt()
        self.client = OpenAIClient(spec.endpoint, api_key=spec.api_key or None,
                                   timeout_s=spec.timeout_s, max_retries=spec.max_retries,
                                   backoff_s=spec.backoff_s, jitter=0.5)
        self.pool = ThreadPoolExecutor(max_workers=max(1, spec.request_concurrency))

    def __call__(self, batch: dict[str, np.ndarray]) -> dict:
        ids = list(batch["id"])
        outcomes = list(self.pool.map(self.caption_one, batch["image"]))
        return _result(ids, [o[0] for o in outcomes], [o[1] for o in outcomes])

    def caption_one(self, jpeg: bytes) -> tuple[str | None, str | None]:
        try:
            payload = self.request(jpeg)
        except Exception as exc:
            return None, f"image: {type(exc).__name__}: {exc}"
        try:
            return self.client.complete(payload).content, None
        except EndpointError as exc:
            return None, str(exc)

    def request(self, jpeg: bytes) -> dict:
        img = model_image(jpeg, self.spec.image_budget)
        buffer = io.BytesIO()
        img.save(buffer, "JPEG", quality=92)
        url = "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()
        part = {"type": "image_url", "image_url": {"url": url}}
        return {"model": self.spec.model,
                "messages": chat_messages(self.prompt, part, image_part="raw"),
                **self.spec.sampling()}


# --- backend: vLLM through ray.data.llm ---------------------------------------------------

def vllm_engine(spec: CaptionerSpec) -> VLLMEngine:
    """The multimodal vLLM stage: one image per prompt, the spec's engine arguments on top.

    No video: vLLM allows 999 items of every modality a model takes unless told otherwise,
    and sizes its start-up memory profile (encoder cache, activations) for the largest of
    them; a caption request never holds a video."""
    engine_kwargs = {"max_model_len": 8192, "limit_mm_per_prompt": {"image": 1, "video": 0},
                     **spec.engine_kwargs}
    return VLLMEngine(model=spec.model, engine_kwargs=engine_kwargs,
                      batch_size=spec.batch_size, concurrency=spec.concurrency,
                      accelerator_type=spec.accelerator_type,
                      continue_on_error=spec.continue_on_error, images=True)


def vllm_processor_config(spec: CaptionerSpec):
    """The `ray.data.llm` processor configuration for the captioning vLLM stage."""
    return vllm_engine(spec).processor_config()


def vllm_preprocess(spec: CaptionerSpec) -> Callable[[dict], dict]:
    """Row -> the processor's request: messages (image as PIL) and sampling params."""
    prompt = spec.prompt()
    sampling = dict(spec.sampling())

    def preprocess(row: dict) -> dict:
        image = model_image(row["image"], spec.image_budget)
        part = {"type": "image_pil", "image_pil": image}
        return {"id": row["id"],
                "messages": chat_messages(prompt, part, image_part="raw"),
                "sampling_params": sampling}

    return preprocess


def vllm_postprocess(row: dict) -> dict:
    error = row.get("__inference_error__") or None
    return {"id": row["id"], "raw": None if error else row.get("generated_text"),
            "error": error}


def build_vllm_captioner(spec: CaptionerSpec):
    return vllm_engine(spec).processor(vllm_preprocess(spec), vllm_postprocess)


# --- the stage ----------------------------------------------------------------------------

def _actor_pool(size: int):
    import ray.data

    return ray.data.ActorPoolStrategy(size=max(1, size))


def model_batches(requests: ray.data.Dataset, spec: CaptionerSpec) -> ray.data.Dataset:
    """The requests in blocks of at most one model batch (streaming, no shuffle).

    An actor task takes whole input blocks and returns its output when the last of them is
    done: fed a Lance fragment's block (hundreds or thousands of rows), the model's captions
    would reach the chunked commits only after the whole block, and a killed run would lose
    it all. In blocks of one batch, each batch's captions leave the actor as they are made.
    """
    return requests.repartition(target_num_rows_per_block=spec.batch_size)


def caption_stage(requests: ray.data.Dataset, spec: CaptionerSpec) -> ray.data.Dataset:
    """Lazy dataset of CAPTIONS_SCHEMA rows for the given requests."""
    version = spec.version()
    if spec.backend == "original":
        raw = requests.map_batches(original_captions, batch_format="pyarrow",
                                   batch_size=4096, zero_copy_batch=True)
    elif spec.backend == "transformers":
        raw = model_batches(requests, spec).map_batches(
            TransformersCaptioner, fn_constructor_args=(spec,), batch_size=spec.batch_size,
            compute=_actor_pool(spec.concurrency), num_gpus=spec.num_gpus or None,
            num_cpus=spec.cpus_per_actor, batch_format="numpy")
    elif spec.backend == "openai":
        raw = model_batches(requests, spec).map_batches(
            OpenAICaptioner, fn_constructor_args=(spec,), batch_size=spec.batch_size,
            compute=_actor_pool(spec.concurrency), num_cpus=0.25, batch_format="numpy")
    else:
        raw = build_vllm_captioner(spec)(requests)
    # Whole blocks (batch_size=None): each model batch is finished as it comes. A fixed
    # batch size here would hold captions back until that many were made, and the chunked
    # commits downstream (chunk_rows) would wait for it. After a model, finishing (a string
    # clean-up) asks for no CPU: with a CPU of its own, Ray Data's resource budget left it no
    # room beside the actor on a small node, and every caption waited for the last batch.
    return raw.map_batches(batch_fn(finish_captions), fn_kwargs={"spec": spec, "version": version},
                           batch_format="pyarrow", batch_size=None,
                           num_cpus=0 if spec.uses_model else None)
