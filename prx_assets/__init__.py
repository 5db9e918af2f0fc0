"""prx-assets: raw image collections to text-to-image pre-training corpora, as Dagster assets."""

__version__ = "0.1.0"
