"""Tiny randomly initialised CLIP and SigLIP vision towers, saved as checkpoint folders
(config, weights, image processor) that `VisionEncoder` loads like real ones. No download:
the weights come from a seeded random init of a config of a few thousand parameters."""

from __future__ import annotations

from pathlib import Path

SIDE = 32


def tiny_vision_tower(folder: Path, kind: str = "clip", seed: int = 0) -> Path:
    import torch
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        CLIPVisionModelWithProjection,
        SiglipImageProcessor,
        SiglipVisionConfig,
        SiglipVisionModel,
    )

    torch.manual_seed(seed)
    shape = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "image_size": SIDE, "patch_size": 8}
    folder = Path(folder)
    if kind == "clip":
        CLIPVisionModelWithProjection(CLIPVisionConfig(**shape, projection_dim=16)
                                      ).save_pretrained(folder)
        CLIPImageProcessor(size={"shortest_edge": SIDE},
                           crop_size={"height": SIDE, "width": SIDE}).save_pretrained(folder)
    elif kind == "siglip":
        SiglipVisionModel(SiglipVisionConfig(**shape)).save_pretrained(folder)
        SiglipImageProcessor(size={"height": SIDE, "width": SIDE}).save_pretrained(folder)
    else:
        raise ValueError(f"unknown tiny vision tower {kind!r}")
    return folder
