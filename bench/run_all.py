"""`make bench`: every stage's benchmark, each printed as a ratio against its baseline."""

from __future__ import annotations

import importlib
import sys

# `bench.scale` runs the whole graph on 500, 2,000 and 10,000 generated JPEGs (tens of
# minutes on two cores; PRX_SCALE_IMAGES=1000 for a quick look), so it runs last.
STAGES = ["bench.ingest", "bench.image_stage", "bench.subsampling", "bench.fidelity",
          "bench.captions", "bench.mds", "bench.optout_guard", "bench.rights", "bench.labels",
          "bench.attributes", "bench.dedup",
          "bench.semantic", "bench.browser", "bench.s3", "bench.leases", "bench.incremental",
          "bench.growth", "bench.global_growth", "bench.plan_growth", "bench.source_sensor",
          "bench.soak",
          "bench.scale"]


def main() -> int:
    print(f"{'stage':<10} {'metric':<28} {'value':>10} {'unit':<10} baseline")
    for name in STAGES:
        importlib.import_module(name).main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
