from pathlib import Path

import pytest

from prx_assets.stages.ingest.sources import SourcesError, load_sources
from prx_assets.testing.sources import write_sources


def test_loads_sources_in_order_with_defaults_and_relative_uris(tmp_path: Path):
    path = write_sources(tmp_path / "s.yaml", [
        "{name: web_a, kind: image_folder, uri: imgs, license: cc0, weight: 2}",
        "{name: tars, kind: webdataset, uri: /abs/tars, caption_extension: json}",
        "{name: pq, kind: parquet, uri: p.parquet, image_column: img, image_is_path: true}",
        "{name: ln, kind: lance, uri: t.lance, key_column: key}",
    ])
    config = load_sources(path)
    assert config.names == ["web_a", "tars", "pq", "ln"]
    assert config.get("web_a").weight == 2.0 and config.get("web_a").license == "cc0"
    assert config.get("tars").license == "unknown"
    assert config.uri_of("web_a") == (tmp_path / "imgs").resolve()
    assert config.uri_of("tars") == Path("/abs/tars")
    assert config.get("pq").image_is_path is True


def test_a_provenance_mapping_names_the_sources_own_keys(tmp_path: Path):
    path = write_sources(tmp_path / "s.yaml", [
        "{name: pq, kind: parquet, uri: p, provenance: {license: LICENSE, attribution: by}}"])
    names = load_sources(path).get("pq").provenance_names()
    assert names["license"] == ("LICENSE",) and names["attribution"] == ("by",)
    assert names["license_url"] == ("license_url",)  # the default where not named


@pytest.mark.parametrize("entry, message", [
    ("{name: Bad-Name, kind: image_folder, uri: x}", "field 'name'"),
    ("{kind: image_folder, uri: x}", "field 'name'"),
    ("{name: a, kind: zip, uri: x}", "source #1 'a': field 'kind'"),
    ("{name: a, kind: image_folder}", "field 'uri'"),
    ("{name: a, kind: image_folder, uri: x, colour: red}", "field 'colour'"),
    ("{name: a, kind: image_folder, uri: x, weight: -1}", "field 'weight'"),
    ("{name: a, kind: image_folder, uri: x, image_column: img}", "field 'image_column'"),
    ("{name: a, kind: lance, uri: x}", "field 'key_column'"),
    ("{name: a, kind: parquet, uri: x, image_is_path: maybe}", "field 'image_is_path'"),
    ("{name: a, kind: parquet, uri: x, provenance: {licence: l}}", "'licence' is not one"),
    ("{name: a, kind: parquet, uri: x, provenance: [license]}", "field 'provenance'"),
    ("{name: a, kind: image_folder, uri: x, provenance: {license: l}}", "field 'provenance'"),
])
def test_invalid_entries_name_source_and_field(tmp_path: Path, entry: str, message: str):
    path = write_sources(tmp_path / "s.yaml", [entry])
    with pytest.raises(SourcesError, match=message):
        load_sources(path)


def test_duplicate_names_are_rejected(tmp_path: Path):
    path = write_sources(tmp_path / "s.yaml", [
        "{name: a, kind: image_folder, uri: x}", "{name: a, kind: parquet, uri: y}"])
    with pytest.raises(SourcesError, match=r"source #2 'a'.*duplicate"):
        load_sources(path)


@pytest.mark.parametrize("text, message", [
    ("sources: [unclosed", "not valid YAML"),
    ("sources: []", "non-empty list"),
    ("just a string", "non-empty list"),
    ("sources:\n  - 42\n", "source #1: expected a mapping"),
])
def test_malformed_files_give_clear_errors(tmp_path: Path, text: str, message: str):
    path = tmp_path / "s.yaml"
    path.write_text(text)
    with pytest.raises(SourcesError, match=message):
        load_sources(path)


def test_missing_file_is_a_clear_error(tmp_path: Path):
    with pytest.raises(SourcesError, match="sources file not found"):
        load_sources(tmp_path / "nope.yaml")


def test_repo_sources_file_is_valid():
    config = load_sources(Path(__file__).parents[3] / "sources.yaml")
    assert {"demo_folder", "demo_wds", "demo_parquet"} <= set(config.names)
