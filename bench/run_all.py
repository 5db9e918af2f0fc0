"""`make bench`: every stage's benchmark, each printed as a ratio against its baseline."""

from __future__ import annotations

import importlib
import sys

STAGES = ["bench.ingest", "bench.image_stage", "bench.subsampling", "bench.captions", "bench.mds",
          "bench.labels", "bench.dedup"]


def main() -> int:
    print(f"{'stage':<10} {'metric':<28} {'value':>10} {'unit':<10} baseline")
    for name in STAGES:
        importlib.import_module(name).main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
