"""Which Pillow build is loaded: stock Pillow or pillow-simd (SIMD resampling, ~2x the image
stage per core). Both install under the same `PIL` name, so the distribution is identified
by the one whose install record matches the loaded `PIL._imaging` binary byte for byte.

`python -m prx_assets.stages.images.pil_backend` prints the backend (`make install` says it).
"""

from __future__ import annotations

import base64
import hashlib
import sys
from dataclasses import dataclass
from functools import lru_cache
from importlib import metadata
from pathlib import Path

import PIL
from PIL import features

STOCK, SIMD, UNKNOWN = "pillow", "pillow-simd", "unknown"
# What the image stage needs from any build: JPEG, PNG (zlib) and WebP codecs.
REQUIRED_CODECS = ("jpg", "zlib", "webp")


@dataclass(frozen=True)
class Backend:
    name: str  # "pillow", "pillow-simd" or "unknown"
    version: str  # PIL.__version__ as loaded
    missing_codecs: tuple[str, ...] = ()

    @property
    def simd(self) -> bool:
        return self.name == SIMD

    def describe(self) -> str:
        text = f"{self.name} {self.version}"
        return text + (f" (missing codecs: {', '.join(self.missing_codecs)})"
                       if self.missing_codecs else "")


def _record_hash(path: Path) -> str:
    digest = hashlib.sha256(path.read_bytes()).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def _owner(binary: Path) -> str:
    """The distribution whose RECORD lists `binary` with its current hash."""
    actual = None
    for name in (SIMD, STOCK):
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        if dist.version != PIL.__version__:
            continue  # files replaced on disk since this process imported PIL
        for entry in dist.files or ():
            if entry.name == binary.name and entry.hash is not None:
                try:
                    located = str(dist.locate_file(entry))
                    same_file = Path(located).resolve() == binary.resolve()
                except OSError:
                    same_file = False
                if same_file:
                    actual = actual or _record_hash(binary)
                    if f"{entry.hash.mode}={entry.hash.value}" == actual:
                        return name
    return UNKNOWN


@lru_cache(maxsize=1)
def current() -> Backend:
    from PIL import _imaging

    missing = tuple(c for c in REQUIRED_CODECS if not features.check(c))
    return Backend(_owner(Path(_imaging.__file__)), PIL.__version__, missing)


def main() -> int:
    backend = current()
    print(f"image backend: {backend.describe()}")
    return 1 if backend.missing_codecs else 0


if __name__ == "__main__":
    sys.exit(main())
