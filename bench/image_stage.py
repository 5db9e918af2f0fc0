"""Image stage per core, on real photos: the kernel (one decode: bucket, resize, Q92 encode,
phash) on each Pillow build against a naive stock-Pillow pipeline (decode, exact Lanczos, Q92
encode, then `imagehash.phash` on a second decode) and against a bare decode of the same
files, as ratios; the stored JPEGs' PSNR against the exact Lanczos bucket, next to the naive
pipeline's; and phash agreement with stock `imagehash.phash` of the original file.

Photos: every sample photo scikit-image and matplotlib ship, as shipped and rescaled (stock
Pillow's Lanczos, written once to bench/out/image_photos/ so both builds read the same
bytes) to 1.5-17 MP, JPEG and PNG; they cover all four tiers, upscales and downscales. Each
candidate runs in its own long-lived worker process (`bench/image_worker.py`); rounds
alternate the candidates' order and every figure is a median of per-round ratios (the
machine is shared). Run it on one core:
`nice taskset -c 0 .venv/bin/python -m bench.image_stage` (PRX_BENCH_ROUNDS, default 3;
about 10 minutes on a shared core).
"""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image

from bench.common import OUT, Figure, report
from prx_assets.stages.images import pil_backend
from prx_assets.stages.images.fidelity import psnr

PHOTOS = OUT / "image_photos"
STOCK_DIR = Path(sys.prefix) / "image-backend" / "stock"
SPLIT_IMAGES = 16  # the time split is a share: a third of the photos is enough


class Worker:
    def __init__(self, label: str, stock_dir: Path | None):
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
        args = [sys.executable, "-m", "bench.image_worker",
                *([str(stock_dir)] if stock_dir else [])]
        self.label = label
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     cwd=Path(__file__).resolve().parents[1], env=env)
        self.backend = None

    def load(self, files: list[Path]) -> None:
        self.backend = self.ask("load", [str(f) for f in files])

    def ask(self, command: str, arg=None):
        pickle.dump((command, arg), self.proc.stdin)
        self.proc.stdin.flush()
        return pickle.load(self.proc.stdout)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def measure(rounds: int) -> dict:
    simd = pil_backend.current().simd
    if simd and not (STOCK_DIR / "PIL").is_dir():
        raise SystemExit(f"pillow-simd is loaded but there is no stock Pillow in {STOCK_DIR}: "
                         "run `make install`")
    stock = Worker("stock", STOCK_DIR if simd else None)
    files = [Path(p) for p in stock.ask("photos", str(PHOTOS))]
    workers = {"stock": stock}
    if simd:
        workers["simd"] = Worker("simd", None)
    for worker in workers.values():
        worker.load(files)
    runs = [("stock", "naive"), ("stock", "kernel"), ("stock", "decode")]
    runs += [("simd", "kernel"), ("simd", "decode")] if simd else []
    for worker, candidate in runs:  # warm-up: lazy imports, codec set-up
        workers[worker].ask("time", (candidate, 3))
    seconds = {run: [] for run in runs}
    for r in range(rounds):
        for run in runs[r % len(runs):] + runs[:r % len(runs)]:
            seconds[run].append(workers[run[0]].ask("time", (run[1], len(files))))
            print(f"round {r + 1}: {run[0]} {run[1]} {seconds[run][-1]:.1f} s CPU", flush=True)
    reference = stock.ask("reference")
    outputs = {run: workers[run[0]].ask("outputs", run[1]) for run in runs if run[1] != "decode"}
    splits = {name: w.ask("split", SPLIT_IMAGES) for name, w in workers.items()}
    result = {"files": files, "seconds": seconds, "reference": reference, "outputs": outputs,
              "splits": splits, "backends": {n: w.backend for n, w in workers.items()}}
    for w in workers.values():
        w.close()
    return result


def _median_ratio(a: list[float], b: list[float]) -> float:
    """Median over rounds of a[r] / b[r]."""
    return float(np.median([x / y for x, y in zip(a, b, strict=True)]))


def fidelity(result: dict, run: tuple[str, str]) -> dict:
    """PSNR of the run's stored JPEGs against the exact bucket, minus the naive pipeline's,
    and phash agreement with stock imagehash."""
    deltas, agree, hashed = [], 0, 0
    naive = result["outputs"][("stock", "naive")]
    for (exact, ref_hash), (jpeg, phash), (naive_jpeg, _) in zip(
            result["reference"], result["outputs"][run], naive, strict=True):
        if jpeg is None:
            continue
        ours = psnr(exact, np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB")))
        base = psnr(exact, np.asarray(Image.open(io.BytesIO(naive_jpeg)).convert("RGB")))
        deltas.append(ours - base)
        hashed += 1
        agree += phash == ref_hash
    return {"median_db": float(np.median(deltas)), "worst_db": float(min(deltas)),
            "agree": agree, "hashed": hashed}


def main() -> list[Figure]:
    rounds = int(os.environ.get("PRX_BENCH_ROUNDS", "3"))
    result = measure(rounds)
    s = result["seconds"]
    n = len(result["files"])
    mp = [Image.open(f).size for f in result["files"]]
    mp = [w * h / 1e6 for w, h in mp]
    print(f"image stage: {n} real photos ({min(mp):.2f}-{max(mp):.1f} MP), {rounds} rounds, "
          f"CPU time of one process each; builds: {result['backends']}")
    naive = s[("stock", "naive")]
    figures, rows = [], []
    for build in ("stock", "simd"):
        if (build, "kernel") not in s:
            continue
        kernel, bare = s[(build, "kernel")], s[(build, "decode")]
        vs_naive = _median_ratio(naive, kernel)
        vs_decode = _median_ratio(kernel, bare)
        fid = fidelity(result, (build, "kernel"))
        name = " ".join(result["backends"][build])
        rows.append((f"kernel on {name}", vs_naive, vs_decode, fid))
        figures += [
            Figure("image", f"{build} kernel img/s/core", n / float(np.median(kernel)),
                   "naive stock Pillow", n / float(np.median(naive)), "img/s"),
            Figure("image", f"{build} bare decode img/s", n / float(np.median(bare)),
                   f"{build} kernel", n / float(np.median(kernel)), "img/s"),
            Figure("image", f"{build} PSNR delta median", fid["median_db"],
                   "naive pipeline (0 dB)", 0.0, "dB"),
            Figure("image", f"{build} PSNR delta worst", fid["worst_db"],
                   "bound -0.2 dB", -0.2, "dB"),
            Figure("phash", f"{build} phash = stock imagehash", fid["agree"],
                   "images hashed", fid["hashed"], "images"),
        ]
    naive_fid = fidelity(result, ("stock", "naive"))
    rows.insert(0, ("naive stock Pillow (two decodes)", 1.0,
                    _median_ratio(naive, s[("stock", "decode")]), naive_fid))
    rows.append((f"bare decode ({' '.join(result['backends']['stock'])})",
                 _median_ratio(naive, s[("stock", "decode")]), 1.0, None))
    print("| pipeline | x naive stock Pillow | stage / bare decode | PSNR delta median / worst "
          "| phash = stock imagehash |")
    print("| --- | --- | --- | --- | --- |")
    for label, vs_naive, vs_decode, fid in rows:
        fid_text = ("-", "-") if fid is None else (
            f"{fid['median_db']:+.3f} / {fid['worst_db']:+.3f} dB",
            f"{fid['agree']}/{fid['hashed']}")
        print(f"| {label} | {vs_naive:.2f} | {vs_decode:.2f} | {fid_text[0]} | {fid_text[1]} |")
    for build, steps in result["splits"].items():
        total = sum(steps.values())
        print(f"{build} kernel time split: " + ", ".join(
            f"{k} {v / total:.0%}" for k, v in steps.items()))
    report(figures, "image_stage")
    return figures


if __name__ == "__main__":
    main()
