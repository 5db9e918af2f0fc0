"""Caption rows, versions and post-processing (no model code here: see captioners.py).

A caption version is a short hash of everything that changes what a caption says (backend,
model, prompt text, sampling parameters, image budget), so several versions can live side by
side in one table and downstream assets pick the active one.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from dataclasses import dataclass
from importlib import resources

import pyarrow as pa

from prx_assets.storage.filters import all_of, eq_filter, in_filter

CAPTIONS_SCHEMA = pa.schema([
    pa.field("id", pa.string(), nullable=False),
    pa.field("caption_version", pa.string(), nullable=False),
    pa.field("caption", pa.string()),
    pa.field("n_words", pa.int32()),
    pa.field("model", pa.string()),
    pa.field("backend", pa.string()),
    pa.field("status", pa.string(), nullable=False),
    pa.field("error", pa.string()),
    pa.field("created_at", pa.timestamp("us", tz="UTC")),
])

STATUS_OK = "ok"
STATUS_REFUSED = "refused"  # the model declined to describe the image
STATUS_EMPTY = "empty"  # nothing usable came back (or the source had no caption)
STATUS_FAILED = "failed"  # an error: retried on the next run
# Statuses that count as done for a version: everything except a failure.
FINAL_STATUSES = (STATUS_OK, STATUS_REFUSED, STATUS_EMPTY)

TARGET_WORDS = (100, 200)
DEFAULT_PROMPT = "caption_v1"


def active_caption_filter(version: str) -> str:
    """Lance SQL filter for the usable captions of one version."""
    condition = all_of(eq_filter("caption_version", _checked_version(version)),
                       eq_filter("status", STATUS_OK))
    assert condition is not None  # two conditions, neither empty
    return condition


def done_filter(version: str) -> str:
    """Rows of a version that need no more work (failures are retried)."""
    condition = all_of(eq_filter("caption_version", _checked_version(version)),
                       in_filter("status", FINAL_STATUSES))
    assert condition is not None  # two conditions, neither empty
    return condition


def _checked_version(text: str) -> str:
    """A caption version as versions are made (backend and hash); anything else is a config
    mistake worth stopping on, not a value to look up."""
    if not re.fullmatch(r"[A-Za-z0-9_.:-]+", text):
        raise ValueError(f"caption version {text!r} has characters a version never has")
    return text


def load_prompt(name: str = DEFAULT_PROMPT) -> str:
    """A system prompt shipped in prx_assets/stages/captions/prompts/<name>.txt."""
    path = resources.files("prx_assets.stages.captions").joinpath("prompts", f"{name}.txt")
    if not path.is_file():
        raise FileNotFoundError(f"no caption prompt named {name!r} (looked for {path})")
    return path.read_text(encoding="utf-8").strip()


def caption_version(backend: str, model: str, prompt: str, sampling: dict,
                    image_budget: int) -> str:
    """Twelve hex digits naming what produced a caption; stable across runs and machines."""
    payload = json.dumps({"backend": backend, "model": model, "prompt": prompt,
                          "sampling": sampling, "image_budget": image_budget},
                         sort_keys=True, ensure_ascii=True)
    return f"{backend}-{hashlib.blake2b(payload.encode(), digest_size=6).hexdigest()}"


@dataclass(frozen=True)
class CleanCaption:
    caption: str
    status: str
    error: str | None = None

    @property
    def n_words(self) -> int:
        return count_words(self.caption)


_REFUSAL = re.compile(
    r"^\W*(i'?m sorry|i am sorry|sorry,|i can(?:'|no)t|i cannot|i am unable|i'm unable|"
    r"as an ai|i won'?t be able|unable to (?:describe|help|assist))", re.IGNORECASE)
_PREAMBLE = re.compile(
    r"^\s*(?:\*\*)?(?:caption|description)(?:\*\*)?\s*:\s*", re.IGNORECASE)
_SENTENCE_END = re.compile(r"[.!?][\"')\]]?(?=\s|$)")
_FINISHED = re.compile(r"[.!?][\"')\]]?$")


def count_words(text: str) -> int:
    return len(text.split())


def clean_caption(raw: str | None) -> CleanCaption:
    """Whitespace to one paragraph, a leading "Caption:" dropped, a cut-off last sentence
    trimmed back to the last full stop, refusals and empty answers marked."""
    text = " ".join((raw or "").split())
    text = _PREAMBLE.sub("", text).strip().strip('"').strip()
    if not text:
        return CleanCaption("", STATUS_EMPTY, "no text in the answer")
    if _REFUSAL.match(text):
        return CleanCaption(text, STATUS_REFUSED, "the model declined")
    return CleanCaption(_trim_unfinished_sentence(text), STATUS_OK)


def _trim_unfinished_sentence(text: str) -> str:
    """A generation stopped by max_tokens ends mid-sentence: keep the complete sentences
    when they hold most of the text, else keep it all (a caption without full stops)."""
    if _FINISHED.search(text):
        return text
    ends = list(_SENTENCE_END.finditer(text))
    if not ends:
        return text
    cut = ends[-1].end()
    return text[:cut] if cut >= len(text) // 2 else text


def word_histogram(counts: list[int], edges: tuple[int, ...] = (0, 50, 100, 150, 200, 250, 300)
                   ) -> list[tuple[str, int]]:
    """Caption lengths in bins, the 100-200 target visible in the middle."""
    bins = [0] * len(edges)
    for n in counts:
        i = max(j for j, edge in enumerate(edges) if n >= edge)
        bins[i] += 1
    labels = [f"{lo}-{hi - 1}" for lo, hi in itertools.pairwise(edges)] + [f"{edges[-1]}+"]
    return list(zip(labels, bins, strict=True))
