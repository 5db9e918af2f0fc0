"""The CPU default: attributes derived from the caption text alone, zero-shot.

Each enum value has a short description; a caption gets, per field, the value whose
description its MiniLM embedding is closest to (cosine). `subjects` keeps the best value and
those nearly as close (up to the schema's maximum). A watermark or logo counts only when the
caption names one (a caption describes what is visible, so its words are the evidence).
A field is written only where the zero-shot beats always answering the most common value on
the hand-labelled captions (`EMITTED`, kept so by a test); every other field is null, with
why in the record's `withheld`, and every record is marked `caption_derived`: a curator
filters on it knowing where it came from.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from prx_assets.models.embeddings import MiniLMEmbedder, shared_embedder
from prx_assets.stages.attributes.schema import SCHEMA_VERSION, fields

# value -> description, per field; every enum value of the schema has one (checked below).
DESCRIPTIONS: dict[str, dict[str, str]] = {
    "medium": {
        "photo": "a photograph taken with a camera of a real scene",
        "illustration": "a drawn or digital illustration, a drawing or a vector graphic",
        "painting": "a painting on canvas with brush strokes, oil or watercolour paint",
        "3d_render": "a computer generated 3D render with smooth shaded surfaces",
        "screenshot": "a screenshot of a computer screen, an app or a website interface",
        "document": "a scanned document or page of printed text, a letter, a form or receipt",
        "diagram": "a chart, graph, diagram or infographic with labels and axes",
        "other": "an abstract image that is hard to classify",
    },
    "subjects": {
        "people": "people, a person, a man, a woman or a child",
        "animal": "an animal such as a dog, cat, bird, horse or wild animal",
        "plant": "plants, flowers, trees or leaves",
        "food": "food, a meal, a dish, fruit or a drink",
        "vehicle": "a vehicle such as a car, bus, bicycle, boat, train or plane",
        "building": "a building, a house, architecture, a street or a room interior",
        "landscape": "a landscape with mountains, sea, sky, fields or a forest",
        "object": "an everyday object or product on a surface",
        "text": "written text, words, letters, a sign or a page",
        "pattern": "an abstract pattern, texture or geometric shapes",
    },
    "people": {
        "none": "no people, nobody, an empty scene without any person",
        "one": "a single person alone, one man or one woman",
        "two": "two people, a couple, a pair of persons",
        "few": "a small group of three or four people",
        "many": "a large crowd of many people",
    },
    "visible_text": {
        "none": "no text or writing is visible anywhere",
        "some": "a small sign, label or caption with a few words is visible",
        "dominant": "the image is mostly text: a page, a document or a slide full of words",
    },
    "setting": {
        "indoor": "an indoor scene inside a room, a kitchen, an office or a building",
        "outdoor": "an outdoor scene outside under the sky, in a street, a park or nature",
        "studio": "a studio shot against a plain seamless backdrop",
        "abstract": "no physical place, a flat graphic or an abstract background",
    },
    "lighting": {
        "daylight": "natural daylight and sunlight",
        "artificial": "artificial light from lamps, neon or street lights",
        "low_light": "dim, dark, night-time low light with deep shadows",
        "studio": "soft even studio lighting with softboxes",
        "flat": "flat uniform lighting of a graphic, screen or scan without shadows",
    },
    "composition": {
        "close_up": "a close-up, macro detail filling the frame",
        "portrait": "a portrait framing a person's head and shoulders",
        "medium": "a medium shot showing a subject and some of its surroundings",
        "wide": "a wide shot of a broad scene or panorama",
        "aerial": "an aerial view from above, a drone or bird's eye view",
        "flat_lay": "a flat lay of objects arranged on a table seen from directly above",
    },
    "style": {
        "realistic": "a realistic, natural, true to life depiction",
        "stylized": "a stylized artistic depiction with bold colours",
        "cartoon": "a cartoon, comic or anime style drawing",
        "vintage": "a vintage, old, faded, sepia or black and white look",
        "minimalist": "a minimalist, simple, clean design with lots of empty space",
    },
}
# Within this cosine of the best subject, another subject is kept too.
SUBJECT_MARGIN = 0.03
_WATERMARK = re.compile(r"\b(watermark\w*|logo\w*|copyright|stock photo)\b", re.IGNORECASE)
# Fields no caption can honestly tell: left null.
NOT_FROM_CAPTIONS = ("technical_quality", "aesthetic_quality")
# The fields written: each agrees with the hand-labelled captions more often than the most
# common value does (prx_assets_tests/fixtures/attribute_captions.jsonl, 32 captions).
EMITTED = ("medium", "setting", "watermark")
WITHHELD_BECAUSE = {
    "people": "below the most-common-value baseline on the hand-labelled captions "
              "(31 % against 69 %)",
    "visible_text": "below the most-common-value baseline on the hand-labelled captions "
                    "(31 % against 56 %)",
    "subjects": "no hand labels to measure it against",
    "lighting": "no hand labels to measure it against",
    "composition": "no hand labels to measure it against",
    "style": "no hand labels to measure it against",
    **dict.fromkeys(NOT_FROM_CAPTIONS, "a caption cannot tell it"),
}


def withheld_reason(emitted: tuple[str, ...] = EMITTED, version: str = SCHEMA_VERSION
                    ) -> str | None:
    """`field: why; ...` for each schema field the caption backend leaves null."""
    reasons = [f"{f.name}: {WITHHELD_BECAUSE.get(f.name, 'not emitted')}"
               for f in fields(version) if f.name not in emitted]
    return "; ".join(reasons) or None


def check_descriptions(version: str = SCHEMA_VERSION) -> None:
    """Every enum value of the schema has a description, and nothing else does."""
    for f in fields(version):
        if f.kind in ("enum", "enum_list"):
            have = set(DESCRIPTIONS.get(f.name, {}))
            if have != set(f.values):
                raise ValueError(f"descriptions of {f.name!r} {sorted(have)} do not match the "
                                 f"schema's values {sorted(f.values)}")


class CaptionAttributer:
    """Caption texts in, partial attribute records out (MiniLM on the CPU): the `emit`
    fields only (the measured ones by default; the evaluation asks for every field)."""

    def __init__(self, embedder: MiniLMEmbedder | None = None,
                 version: str = SCHEMA_VERSION, threads: int = 1,
                 emit: tuple[str, ...] = EMITTED):
        check_descriptions(version)
        self.embedder = embedder or shared_embedder(threads)
        self.version = version
        self.emit = emit
        self.choices = {name: (list(values), self.embedder.embed(list(values.values())))
                        for name, values in DESCRIPTIONS.items()}

    def records(self, captions: Sequence[str]) -> list[dict[str, Any]]:
        vectors = self.embedder.embed([c or "" for c in captions])
        per_field = {name: vectors @ descriptions.T
                     for name, (_, descriptions) in self.choices.items()}
        return [self._record(caption, {name: scores[i] for name, scores in per_field.items()})
                for i, caption in enumerate(captions)]

    def _record(self, caption: str, scores: dict[str, np.ndarray]) -> dict[str, Any]:
        record: dict[str, Any] = {}
        for f in fields(self.version):
            if f.name in NOT_FROM_CAPTIONS or f.name not in self.emit:
                continue
            if f.kind == "boolean":
                record[f.name] = bool(_WATERMARK.search(caption or ""))
                continue
            values, score = self.choices[f.name][0], scores[f.name]
            if f.kind == "enum":
                record[f.name] = values[int(score.argmax())]
                continue
            order = np.argsort(-score, kind="stable")
            best = score[order[0]]
            record[f.name] = [values[j] for j in order[:f.max_items]
                              if score[j] >= best - SUBJECT_MARGIN]
        return record
