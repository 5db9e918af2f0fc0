"""The pipeline's stages, one package each: pure, typed logic over Ray and Lance, no Dagster.

Roughly in the order a source goes through them (the exact order, each asset's partitioning
and upstreams, and the jobs that run them: `prx_assets.registry`):

1. `ingest`      raw files of a source into `raw_images`
2. `images`      one decode per image: filter, tier and shape, Lanczos, JPEG Q92, phash
3. `captions`    dense re-captions, versioned
4. `labels`      caption classification (visual / text / nsfw)
   `attributes`  structured attribute tags (medium, subjects, text, quality, ...)
5. `dedup`       exact pHash duplicates across sources (global)
6. `semantic`    image embeddings, SemDeDup and concept balance (global steps)
7. `opt_outs`    the audited opt-out requests (global)
8. `shards`      MDS trees per tier and shape
9. `skip_lists`  per-shard sidecars: dedup, semdedup, balance, labels, opt-outs, ablations
10. `corpus`     the searchable table over every source (global)
11. `subsets`    named fine-tuning subsets of subsets.yaml, each its own MDS tree

Their Dagster wiring is `prx_assets.defs.<stage>`.
"""
