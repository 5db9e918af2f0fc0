"""Batches of one shape: images stacked into a uint8 tensor, captions optionally encoded.

Text latents are not stored in the shards; a trainer passes `encode_captions`, any callable
from a list of captions to whatever its model wants (a tensor, a dict of tensors), and the
collate function calls it once per batch (inside the DataLoader worker when num_workers > 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch

CaptionEncoder = Callable[[list[str]], Any]


@dataclass
class ShapeBatchCollate:
    """Collate MDS samples of one shape into {"image": (B, 3, H, W) uint8, "caption", ...}.

    Picklable (a dataclass holding a callable), so it works with DataLoader workers as long as
    `encode_captions` is picklable too (a module-level function or an nn.Module)."""

    encode_captions: Optional[CaptionEncoder] = None

    def __call__(self, samples: list[dict]) -> dict[str, Any]:
        shapes = {(s["width"], s["height"]) for s in samples}
        if len(shapes) != 1:
            raise ValueError(f"a batch mixes shapes {sorted(shapes)}; use per_stream batching")
        images = np.stack([np.asarray(s["image"].convert("RGB")) for s in samples])
        batch: dict[str, Any] = {
            "image": torch.from_numpy(images).permute(0, 3, 1, 2).contiguous(),
            "caption": [s["caption"] for s in samples],
            "id": [s["id"] for s in samples],
            "source": [s["source"] for s in samples],
            "original_size": torch.tensor([[s["original_width"], s["original_height"]]
                                           for s in samples], dtype=torch.int64),
        }
        if self.encode_captions is not None:
            batch["caption_latents"] = self.encode_captions(batch["caption"])
        return batch
