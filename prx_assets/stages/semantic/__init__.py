"""Semantic curation: image embeddings, embedding-space dedup (SemDeDup) and concept
balance (hierarchical k-means), as pure, typed functions over arrays (no Dagster)."""
