"""Where things live: the storage root and the sources file, from the environment."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_DATA_ROOT = "./data"


def data_root() -> Path:
    return Path(os.environ.get("PRX_DATA_ROOT", DEFAULT_DATA_ROOT)).resolve()
