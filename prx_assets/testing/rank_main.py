"""One simulated training rank (run as a subprocess): iterate an epoch, print batch ids.

Usage: python -m prx_assets.testing.rank_main MDS_ROOT TIER BATCH NUM_WORKERS
with RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE / MASTER_ADDR / MASTER_PORT set.
"""

import json
import sys

from prx_assets.loader import build_loader


def main() -> None:
    root, tier, batch, workers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    loader = build_loader(root, tier, batch, weights={"alpha": 1.0, "beta": 1.0}, seed=7,
                          num_workers=workers)
    print(json.dumps([b["id"] for b in loader]))


if __name__ == "__main__":
    main()
