"""Skip-list sidecars: `shard.NNNNN.skip.json` beside each MDS shard.

Format (design contract): {"version": 1, "lists": {"<reason>": [sorted shard-local indices]}}.
An absent sidecar means nothing in that shard is skipped.
"""

from __future__ import annotations

import json
from pathlib import Path

SIDECAR_VERSION = 1


def sidecar_path(shard_path: str | Path) -> Path:
    """`.../shard.00003.mds` -> `.../shard.00003.skip.json`."""
    shard_path = Path(shard_path)
    return shard_path.with_name(shard_path.name.removesuffix(".mds") + ".skip.json")


def read_sidecar(path: str | Path) -> dict[str, list[int]]:
    """The skip lists of one shard by reason; {} when the sidecar does not exist."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return {}
    if data.get("version") != SIDECAR_VERSION:
        raise ValueError(f"{path}: unsupported skip sidecar version {data.get('version')!r}")
    return {str(reason): [int(i) for i in indices] for reason, indices in data["lists"].items()}
