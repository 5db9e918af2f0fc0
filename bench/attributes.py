"""Attributes and subsets: tagging's pipeline overhead against the bare structured-decoding
loop with the tiny random model (one thread each), structured-decoding validity, a subset's
build time against a plain filtered copy of the same rows, and the caption-derived CPU
default's agreement with hand-labelled attributes (prx_assets_tests/fixtures/
attribute_captions.jsonl, 32 captions written and labelled by hand).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
from streaming import MDSWriter, StreamingDataset

from bench.common import Figure, report, timed
from prx_assets.engine import ray_runtime
from prx_assets.stages.attributes.backends import chat_prompt, load_decoder
from prx_assets.stages.attributes.caption_derived import CaptionAttributer
from prx_assets.stages.attributes.runs import AttributerSpec, tag_source
from prx_assets.stages.attributes.schema import parse_record
from prx_assets.stages.captions.captions import CAPTIONS_SCHEMA, active_caption_filter
from prx_assets.stages.shards import mds, plan
from prx_assets.stages.subsets.build import ActiveVersions, build_subset
from prx_assets.stages.subsets.definitions import parse_subset
from prx_assets.stages.subsets.tree import SUBSET_COLUMNS
from prx_assets.storage.lance_tables import overwrite_rows
from prx_assets.storage.layout import Storage
from prx_assets.storage.tables import CAPTIONS
from prx_assets.storage.trees import current_tree
from prx_assets.testing.mds_corpus import ACTIVE, build_corpus, inputs_for
from prx_assets.testing.tiny_vlm import build_tiny_qwen3_vl

HAND_LABELLED = Path(__file__).parents[1] / "prx_assets_tests/fixtures/attribute_captions.jsonl"
AGREEMENT_FIELDS = ("medium", "people", "visible_text", "setting", "watermark")
TAGGED = 24  # captions the overhead is measured over (the tiny model: ~1-3 s each)


def hand_labelled() -> list[dict]:
    return [json.loads(line) for line in HAND_LABELLED.read_text().splitlines() if line]


def write_captions(storage: Storage, source: str, captions: list[str]) -> None:
    now = datetime.now(UTC)
    rows = [{"id": f"{source}:{i}", "caption_version": ACTIVE, "caption": c,
             "n_words": len(c.split()), "model": "hand", "backend": "original", "status": "ok",
             "error": None, "created_at": now} for i, c in enumerate(captions)]
    overwrite_rows(storage.table(CAPTIONS, source),
                   pa.Table.from_pylist(rows, schema=CAPTIONS_SCHEMA), CAPTIONS_SCHEMA)


def tagging_figures(work: Path) -> list[Figure]:
    model = build_tiny_qwen3_vl(work / "tiny-qwen3-vl")
    captions = [r["caption"] for r in hand_labelled()][:TAGGED]
    decoder = load_decoder(str(model), threads=1)
    bare, answers = timed(lambda: [decoder.decode(chat_prompt(decoder.tokenizer, c))
                                   for c in captions])
    valid_bare = sum(parse_record(a)[0] is not None for a in answers)  # type: ignore[union-attr]
    storage = Storage(str(work / "data"))
    write_captions(storage, "bench", captions)
    ray_runtime.connect(num_cpus=2)
    spec = AttributerSpec(backend="transformers", model=str(model), batch_size=8)
    run = tag_source(storage.table(CAPTIONS, "bench"), storage.table("attributes", "bench"),
                     ACTIVE, active_caption_filter(ACTIVE), spec, chunk_rows=8)
    statuses = run.counts
    recorded = statuses.get("ok", 0) + statuses.get("invalid", 0)
    print(f"tagging: bare {bare:.1f} s, pipeline {run.seconds:.1f} s, statuses {dict(statuses)}, "
          f"valid in the bare loop {valid_bare}/{len(captions)}")
    return [
        Figure("attributes", "tagging s (pipeline)", run.seconds, "bare decode loop", bare, "s"),
        Figure("attributes", "valid records %", 100 * statuses.get("ok", 0) / len(captions),
               "records", 100.0, "%"),
        Figure("attributes", "valid or with reason %", 100 * recorded / len(captions),
               "records", 100.0, "%"),
    ]


def plain_filtered_copy(data_root: Path, ids: set[str], out: Path) -> None:
    """The naive subset: stream every sample of the source tree, keep the chosen ids, write
    them (decoded and re-encoded by the MDS encoders) into one leaf per shape."""
    tree = current_tree(data_root, "web")
    writers: dict[str, MDSWriter] = {}
    for leaf in sorted(p.parent for p in tree.glob("*/*/index.json")):
        name = f"{leaf.parent.name}/{leaf.name}"
        for sample in StreamingDataset(local=str(leaf), shuffle=False, batch_size=1):
            if sample["id"] not in ids:
                continue
            if name not in writers:
                writers[name] = MDSWriter(out=str(out / name), columns=SUBSET_COLUMNS)
            writers[name].write({**sample, "license": "cc-by-4.0"})
    for writer in writers.values():
        writer.finish()


def subset_figures(work: Path) -> list[Figure]:
    data_root = work / "subset-data"
    build_corpus(data_root, "web", per_shape=100)
    mds.write_mds_tree(inputs_for(data_root, "web"), data_root, "web",
                       plan.WriteOptions(parallel=False))
    storage = Storage(str(data_root))
    definition = parse_subset({"name": "half", "tiers": [1], "target_size": 150})
    built = build_subset(storage, definition, ["web"], {"web": "cc-by-4.0"},
                         ActiveVersions(ACTIVE))
    ids = set(built.selection.rows.column("id").to_pylist())
    plain, _ = timed(lambda: plain_filtered_copy(data_root, ids, work / "plain"))
    print(f"subset: {built.tree.samples} samples in {built.seconds:.2f} s "
          f"(selection {built.select_seconds:.2f} s); plain filtered copy {plain:.2f} s")
    return [Figure("subsets", "subset build s", built.seconds, "plain filtered copy", plain,
                   "s")]


def agreement_figures() -> list[Figure]:
    rows = hand_labelled()
    started = time.perf_counter()
    records = CaptionAttributer().records([r["caption"] for r in rows])
    seconds = time.perf_counter() - started
    figures = []
    for name in AGREEMENT_FIELDS:
        agree = sum(rec.get(name) == row[name] for rec, row in zip(records, rows, strict=True))
        values = [row[name] for row in rows]
        majority = max(values.count(v) for v in set(values))
        print(f"agreement {name}: {agree}/{len(rows)} (majority class {majority}/{len(rows)})")
        figures.append(Figure("attributes", f"caption-derived {name} %",
                              100 * agree / len(rows), "majority class",
                              100 * majority / len(rows), "%"))
    print(f"caption-derived: {len(rows)} captions in {seconds:.1f} s (model load included)")
    return figures


def main() -> list[Figure]:
    work = Path(tempfile.mkdtemp(prefix="bench_attributes_"))
    try:
        figures = agreement_figures() + subset_figures(work) + tagging_figures(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(figures, "attributes")
    return figures


if __name__ == "__main__":
    main()
