"""Resolution tiers and aspect-ratio buckets.

Each tier T has 13 shapes with aspect ratios 2^(k/6) for k = -6..6 (0.5 to 2.0, 1.0
included), each side a multiple of `alignment`, area as close as possible to T², so the
token count per image stays flat within a tier. An image goes to the largest tier it reaches
without upscaling by more than 4/3 (by area: w*h >= (3T/4)²), which makes 384² the floor of
the 512 tier.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

DEFAULT_TIERS = (512, 1024, 2048, 4096)
SHAPES_PER_TIER = 13
MIN_ASPECT, MAX_ASPECT = 0.5, 2.0
MAX_UPSCALE = 4 / 3
DEFAULT_ALIGNMENT = 16

STATUS_TOO_SMALL = "too_small"
STATUS_BAD_ASPECT = "bad_aspect"


@dataclass(frozen=True)
class Shape:
    width: int
    height: int

    @property
    def aspect(self) -> float:
        return self.width / self.height

    @property
    def name(self) -> str:
        return f"{self.width}x{self.height}"


@dataclass(frozen=True)
class BucketRule:
    tiers: tuple[int, ...] = DEFAULT_TIERS
    alignment: int = DEFAULT_ALIGNMENT
    min_aspect: float = MIN_ASPECT
    max_aspect: float = MAX_ASPECT
    max_upscale: float = MAX_UPSCALE
    shapes_per_tier: int = SHAPES_PER_TIER

    @property
    def min_pixels(self) -> float:
        """The floor: the smallest tier reached with the largest allowed upscale (384²)."""
        return (min(self.tiers) / self.max_upscale) ** 2


@dataclass(frozen=True)
class Bucket:
    status: str  # "ok", "too_small" or "bad_aspect"
    tier: int | None = None
    shape: Shape | None = None


def aspect_ratios(n: int = SHAPES_PER_TIER, low: float = MIN_ASPECT,
                  high: float = MAX_ASPECT) -> list[float]:
    """n ratios spaced evenly in log space from low to high (1.0 included when n is odd)."""
    step = (math.log(high) - math.log(low)) / (n - 1)
    return [math.exp(math.log(low) + i * step) for i in range(n)]


def _aligned_shape(tier: int, ratio: float, alignment: int) -> Shape:
    """The aligned (w, h) nearest to area tier² and aspect `ratio`.

    Candidates are the floor/ceil multiples around the exact sides; the choice depends on
    ratio and 1/ratio symmetrically, so the shapes of a tier are transposes of each other.
    """
    exact_w, exact_h = tier * math.sqrt(ratio), tier / math.sqrt(ratio)

    def around(x: float) -> set[int]:
        low = max(alignment, int(x // alignment) * alignment)
        return {low, low + alignment}

    def cost(w: int, h: int) -> tuple[float, float]:
        return (abs(math.log(w * h / tier**2)), abs(math.log((w / h) / ratio)))

    candidates = [(w, h) for w in around(exact_w) for h in around(exact_h)]
    w, h = min(candidates, key=lambda wh: (round(sum(cost(*wh)), 12), wh[0] * wh[1]))
    return Shape(w, h)


@lru_cache(maxsize=64)
def tier_shapes(tier: int, alignment: int = DEFAULT_ALIGNMENT,
                n: int = SHAPES_PER_TIER, low: float = MIN_ASPECT,
                high: float = MAX_ASPECT) -> tuple[Shape, ...]:
    """The tier's shapes ordered by aspect ratio, built for ratios >= 1 and transposed."""
    ratios = aspect_ratios(n, low, high)
    wide = {r: _aligned_shape(tier, r, alignment) for r in ratios if r >= 1.0 - 1e-9}
    shapes = []
    for r in ratios:
        if r >= 1.0 - 1e-9:
            shapes.append(wide[r])
        else:
            mirror = min(wide, key=lambda w: abs(math.log(w) + math.log(r)))
            shapes.append(Shape(wide[mirror].height, wide[mirror].width))
    return tuple(shapes)


def choose_tier(width: int, height: int, rule: BucketRule = BucketRule()) -> int | None:
    """The largest tier reached without upscaling by more than `max_upscale` (by area)."""
    pixels = width * height
    reachable = [t for t in rule.tiers if pixels * rule.max_upscale**2 >= t * t]
    return max(reachable) if reachable else None


def nearest_shape(width: int, height: int, tier: int, rule: BucketRule = BucketRule()) -> Shape:
    """The tier's shape whose aspect ratio is nearest in log space."""
    log_aspect = math.log(width / height)
    shapes = tier_shapes(tier, rule.alignment, rule.shapes_per_tier, rule.min_aspect,
                         rule.max_aspect)
    return min(shapes, key=lambda s: abs(math.log(s.aspect) - log_aspect))


def assign_bucket(width: int, height: int, rule: BucketRule = BucketRule()) -> Bucket:
    """Filter (too small, bad aspect) and bucket an image by its (oriented) size."""
    if width <= 0 or height <= 0 or width * height < rule.min_pixels - 1e-6:
        return Bucket(STATUS_TOO_SMALL)
    aspect = width / height
    if not (rule.min_aspect - 1e-9 <= aspect <= rule.max_aspect + 1e-9):
        return Bucket(STATUS_BAD_ASPECT)
    tier = choose_tier(width, height, rule)
    if tier is None:
        return Bucket(STATUS_TOO_SMALL)
    return Bucket("ok", tier, nearest_shape(width, height, tier, rule))
