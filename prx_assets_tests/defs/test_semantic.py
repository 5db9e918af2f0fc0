"""image_embeddings, semantic_duplicates and concepts through Dagster on two small sources
whose captions hold real paraphrases (MiniLM caption space), then the tiny image encoder."""

import dagster as dg

from prx_assets.definitions import build_defs
from prx_assets.defs.resources import (
    CaptionerResource,
    RayResource,
    SourcesResource,
    StorageResource,
)
from prx_assets.defs.semantic import (
    ImageEncoderResource,
    build_concepts,
    build_image_embeddings,
    build_semantic_duplicates,
)
from prx_assets.models.embeddings import MiniLMEmbedder
from prx_assets.storage.layout import Storage
from prx_assets.testing.corpus_tables import CAPTION_VERSION, write_source
from prx_assets.testing.sources import write_sources
from prx_assets.testing.tiny_vision import tiny_vision_tower

# Two paraphrase pairs (one across sources), and unrelated captions (MiniLM cosine of a
# pair ~0.9, of unrelated captions < 0.45).
WEB = [("bike", "A red bicycle leans against a brick wall next to a wooden door.", "visual"),
       ("dogs1", "Two brown dogs run across a snowy field under a grey sky.", "visual"),
       ("dogs2", "Under a grey sky, a pair of brown dogs are running over a field covered "
                 "in snow.", "visual"),
       ("ramen", "A bowl of ramen with a boiled egg, sliced pork and green onions on a dark "
                 "table.", "visual"),
       ("city", "A city skyline at night with illuminated skyscrapers reflected in a river.",
        "visual")]
STOCK = [("bike2", "Next to a wooden door, a red bike is leaning on a brick wall.", "visual"),
         ("typewriter", "Close-up of a vintage typewriter with round metal keys and a sheet "
                        "of paper.", "visual"),
         ("lighthouse", "A lighthouse on a rocky coast with waves crashing below.", "visual"),
         ("bluebike", "A blue bicycle parked beside a white fence in a sunny garden.",
          "visual")]


def _meta(result, name):
    for event in result.get_asset_materialization_events():
        if event.asset_key.path[-1] == name:
            return event.materialization.metadata
    raise AssertionError(f"{name} not materialised")


def test_semantic_assets_on_paraphrased_captions(ray_session, data_root, tmp_path):
    embedder = MiniLMEmbedder()
    write_source(data_root / "lance", "web", WEB, embedder, extra_kept=1)
    write_source(data_root / "lance", "stock", STOCK, embedder)
    (tmp_path / "imgs").mkdir()
    sources = write_sources(tmp_path / "s.yaml", [
        f"{{name: {name}, kind: image_folder, uri: {tmp_path / 'imgs'}}}"
        for name in ("web", "stock")])
    defs = build_defs(sources)
    assert {"embeddings_job", "semantic_job"} <= {job.name for job in defs.resolve_all_job_defs()}
    partitions = dg.StaticPartitionsDefinition(["web", "stock"])
    resources = {"captioner": CaptionerResource(active_version=CAPTION_VERSION),
                 "image_encoder": ImageEncoderResource(), "ray_cluster": RayResource(),
                 "sources": SourcesResource(path=str(sources)), "storage": StorageResource()}
    instance = dg.DagsterInstance.ephemeral()
    embeddings = build_image_embeddings(partitions)

    for source, n in (("web", 5), ("stock", 4)):
        run = dg.materialize([embeddings], partition_key=source, resources=resources,
                             instance=instance)
        meta = _meta(run, "image_embeddings")
        assert (meta["rows_processed"].value, meta["rows_reused"].value) == (n, 0)
        assert meta["encoder"].value.startswith("caption-minilm:")
        assert "no image encoder configured" in meta["space"].value
    assert _meta(run, "image_embeddings")["not_embedded"].value == 0
    again = _meta(dg.materialize([embeddings], partition_key="web", resources=resources,
                                 instance=instance), "image_embeddings")
    # The extra kept image has no caption: in the caption space it has no vector.
    assert (again["rows_processed"].value, again["rows_reused"].value,
            again["rows_removed"].value, again["not_embedded"].value) == (0, 5, 0, 1)

    config = {"ops": {"semantic_duplicates": {"config": {"eps": 0.15,
                                                         "report_eps": [0.05, 0.15]}},
                      "concepts": {"config": {"level_sizes": [4, 2], "target_share": 0.5,
                                               "min_rows_per_leaf": 1}}}}
    run = dg.materialize([build_semantic_duplicates(), build_concepts()], resources=resources,
                         instance=instance, run_config=config)
    assert run.success
    rows = Storage(data_root).table("semantic_duplicates").to_table().to_pylist()
    groups: dict = {}
    for row in rows:
        groups.setdefault(row["kept_id"], set()).add(row["id"])
    # Paraphrases land in one group each, unrelated captions in none; the web copy is kept
    # (equal pixels: the source listed first), then the smaller id.
    assert groups == {"web:bike": {"web:bike", "stock:bike2"},
                      "web:dogs1": {"web:dogs1", "web:dogs2"}}
    assert not any(row["applied"] for row in rows)  # caption space: reported only
    meta = _meta(run, "semantic_duplicates")
    assert meta["removed"].value == 2 and meta["embeddings"].value == 9
    assert meta["applied_by_skip_lists"].value is False
    assert "| 0.15 (acting) | 0.85 | 2 | 22.22% |" in meta["removed_share_by_eps"].value
    assert "| 0.05 | 0.95 | 0 | 0.00% |" in meta["removed_share_by_eps"].value
    assert meta["largest_groups"].value.records[0].data["group_size"] == 2
    assert meta["input_version/image_embeddings/stock"].value >= 1

    concepts = Storage(data_root).table("concepts").to_table()
    assert concepts.num_rows == 18
    assert sorted(set(concepts.column("level").to_pylist())) == [1, 2]
    level_one = concepts.filter(concepts.column("level").to_numpy() == 1)
    assert 4 <= sum(level_one.column("balanced").to_pylist()) <= 6
    cmeta = _meta(run, "concepts")
    assert cmeta["balanced_samples"].value == sum(level_one.column("balanced").to_pylist())
    assert "clusters before" in cmeta["leaf_sizes"].value
    assert "bicycle" in cmeta["top_clusters"].value or "dogs" in cmeta["top_clusters"].value

    # The image space: a tiny random-init CLIP tower on Ray Data actors. Every fixture image
    # is the same JPEG, so in this space all of web's kept images are one group.
    checkpoint = tiny_vision_tower(tmp_path / "clip", "clip")
    image_resources = {**resources, "image_encoder": ImageEncoderResource(
        checkpoint=str(checkpoint), batch_size=4)}
    meta = _meta(dg.materialize([embeddings], partition_key="web", resources=image_resources,
                                instance=instance), "image_embeddings")
    assert meta["encoder"].value.startswith("clip_vision_model:clip:")
    assert (meta["rows_processed"].value, meta["rows_reused"].value) == (6, 0)
    assert meta["replaced_other_space"].value is True  # 16-d vectors replace the 384-d ones
    run = dg.materialize([build_semantic_duplicates()], resources=image_resources,
                         instance=instance)
    rows = Storage(data_root).table("semantic_duplicates").to_table().to_pylist()
    assert {r["kept_id"] for r in rows} == {"web:bike"}
    assert len(rows) == 6 and all(r["applied"] for r in rows)
    assert _meta(run, "semantic_duplicates")["embeddings"].value == 6
