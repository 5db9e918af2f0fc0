"""A tiny, randomly initialised Qwen3-VL (config, tokenizer, processor) built locally.

For tests, benchmarks and offline trials of the `transformers` captioning path: it exercises
the real model class, processor, chat template and generate loop in milliseconds on a CPU,
with no download. Its captions are noise; its shapes and plumbing are the real ones.
"""

from __future__ import annotations

from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                  "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_tiny_qwen3_vl(folder: Path, seed: int = 0, layers: int = 2) -> Path:
    """Write a loadable model folder (AutoProcessor / AutoModelForImageTextToText)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import (Qwen2TokenizerFast, Qwen2VLImageProcessorFast, Qwen3VLConfig,
                              Qwen3VLForConditionalGeneration, Qwen3VLProcessor)
    from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    folder = Path(folder)
    byte_alphabet = list(bytes_to_unicode().values())
    core = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(byte_alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = Qwen2TokenizerFast(tokenizer_object=core, unk_token=None, bos_token=None,
                                   eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   padding_side="left")
    processor = Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessorFast(patch_size=16, merge_size=2,
                                                  temporal_patch_size=2, min_pixels=32 * 32,
                                                  max_pixels=256 * 256),
        tokenizer=tokenizer,
        video_processor=Qwen3VLVideoProcessor(patch_size=16, merge_size=2, temporal_patch_size=2),
        chat_template=CHAT_TEMPLATE)
    token = tokenizer.convert_tokens_to_ids
    config = Qwen3VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=4096,
                         rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3],
                                       "mrope_interleaved": True},
                         tie_word_embeddings=False),
        vision_config=dict(depth=layers, hidden_size=64, intermediate_size=128, num_heads=4,
                           out_hidden_size=64, patch_size=16, spatial_merge_size=2,
                           temporal_patch_size=2, num_position_embeddings=64,
                           deepstack_visual_indexes=[layers - 1]),
        image_token_id=token("<|image_pad|>"), video_token_id=token("<|video_pad|>"),
        vision_start_token_id=token("<|vision_start|>"),
        vision_end_token_id=token("<|vision_end|>"), tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config).eval()
    _prefer_words(model, tokenizer)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def _prefer_words(model, tokenizer) -> None:
    """Zero the output rows of every token but lower-case letters, space and full stop, so
    the random model writes word-like text (the post-processing then has words to count)."""
    import torch

    allowed = set("abcdefghijklmnopqrstuvwxyz .")
    keep = torch.zeros(model.lm_head.weight.shape[0], dtype=torch.bool)
    for token, index in tokenizer.get_vocab().items():
        text = tokenizer.convert_tokens_to_string([token])
        keep[index] = len(text) == 1 and text in allowed
    with torch.no_grad():
        model.lm_head.weight[~keep] = 0.0
        model.lm_head.weight[keep] *= 20.0
