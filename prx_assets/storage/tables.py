"""Every Lance table the pipeline writes, by name: the one list of them.

Per-source tables live at `lance/<name>/<source>.lance`, global ones at `lance/<name>.lance`
(the design's layout); `Storage` turns a name and a source into that location.
"""

import pyarrow as pa

# Lance's encoding hint for a column: read from the table's schema when the table is created,
# then used by every write to it.
LANCE_COMPRESSION = b"lance-encoding:compression"

RAW_IMAGES = "raw_images"
BUCKETED_IMAGES = "bucketed_images"
PHASHES = "phashes"
CAPTIONS = "captions"
CAPTION_LABELS = "caption_labels"
MDS_SAMPLES = "mds_samples"  # which shard and index holds each sample of the current tree
IMAGE_EMBEDDINGS = "image_embeddings"  # one vector per kept image and encoder
ATTRIBUTES = "attributes"  # one structured record per kept image, caption and attribute version

DUPLICATES = "duplicates"
OPT_OUTS = "opt_outs"
CORPUS = "corpus"
SEMANTIC_DUPLICATES = "semantic_duplicates"  # SemDeDup groups across sources
CONCEPTS = "concepts"  # hierarchical k-means cluster per sample per level, balance flag
# SemDeDup's k-means cluster of every vector, with the vector: what an update regroups.
SEMANTIC_CLUSTERS = "semantic_clusters"

PER_SOURCE = (RAW_IMAGES, BUCKETED_IMAGES, PHASHES, CAPTIONS, CAPTION_LABELS, MDS_SAMPLES,
              IMAGE_EMBEDDINGS, ATTRIBUTES)
GLOBAL = (DUPLICATES, OPT_OUTS, CORPUS, SEMANTIC_DUPLICATES, CONCEPTS, SEMANTIC_CLUSTERS)

# Artifacts that are not Lance tables: each source's MDS tree and the skip-list sidecars
# beside its shards (assets of these names record them).
MDS_SHARDS = "mds_shards"
SKIP_LISTS = "skip_lists"
SUBSETS = "subsets"  # one MDS tree per subset of subsets.yaml (`mds/subsets/<name>`)


def image_bytes_field(name: str = "image") -> pa.Field:
    """A column of encoded image bytes (JPEG, PNG, WebP), stored by Lance as they are:
    its default general-purpose compression saved 2.6 % of a raw_images table's bytes (the
    bytes are compressed already) for 1.3 s of CPU per 1,000 images written (more than
    ingest's whole kernel) and three times the CPU of every read of them."""
    return pa.field(name, pa.large_binary(), metadata={LANCE_COMPRESSION: b"none"})
