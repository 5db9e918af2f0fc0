"""The captioner and classifier resources take their fields from the specs: a setting is
declared once, and the YAML captioner file keeps working."""

import dataclasses
from pathlib import Path

import pytest

from prx_assets.defs.resources import (
    CaptionerResource,
    ClassifierResource,
    captioner_from_file,
    spec_fields,
    spec_values,
)
from prx_assets.stages.captions.captioners import CaptionerSpec
from prx_assets.stages.labels.runs import LabelerSpec

REPO = Path(__file__).resolve().parents[2]


def _defaults(spec: type, exclude=()) -> dict:
    return {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
            for f in dataclasses.fields(spec) if f.name not in exclude}


def test_every_spec_field_is_a_resource_field_with_the_spec_default():
    captioner = CaptionerResource()
    assert {name: getattr(captioner, name) for name in _defaults(CaptionerSpec, {"api_key"})} \
        == _defaults(CaptionerSpec, {"api_key"})
    assert "api_key" not in CaptionerResource.model_fields  # never stored in config
    assert captioner.spec() == CaptionerSpec()
    classifier = ClassifierResource()
    for name, default in _defaults(LabelerSpec, {"openai", "vllm"}).items():
        assert getattr(classifier, name) == default
    assert classifier.spec().l2 == LabelerSpec().l2


def test_a_field_added_to_a_spec_reaches_the_resource_without_being_copied():
    @dataclasses.dataclass(frozen=True)
    class Spec:
        size: int = 3
        name: str | None = None
        options: dict = dataclasses.field(default_factory=dict)
        secret: str = ""

    class Resource(spec_fields(Spec, exclude=("secret",))):
        extra: int = 1

    resource = Resource(size=5, options={"a": 1})
    assert set(Resource.model_fields) == {"size", "name", "options", "extra"}
    assert Spec(**spec_values(resource, Spec, exclude=("secret",))) == \
        Spec(size=5, options={"a": 1})


def test_resource_values_reach_the_spec_and_the_key_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("MY_KEY", "sk-test")
    spec = CaptionerResource(backend="openai", model="qwen3-vl", endpoint="http://h/v1",
                             api_key_env="MY_KEY", max_retries=7, temperature=0.5).spec()
    assert (spec.backend, spec.model, spec.endpoint, spec.api_key, spec.max_retries,
            spec.temperature) == ("openai", "qwen3-vl", "http://h/v1", "sk-test", 7, 0.5)
    labeler = ClassifierResource(backend="openai", base_url="http://h/v1", batch_size=8,
                                 l2=0.01, api_key_env="MY_KEY").spec()
    assert (labeler.backend, labeler.batch_size, labeler.l2, labeler.openai.api_key) == \
        ("openai", 8, 0.01, "sk-test")
    assert labeler.version() != ClassifierResource(backend="openai", base_url="http://h/v1",
                                                   model="other").spec().version()


def test_the_example_captioner_file_loads_through_prx_captioner(monkeypatch, tmp_path):
    monkeypatch.setenv("PRX_CAPTIONER", str(REPO / "captioner.example.yaml"))
    captioner = captioner_from_file()
    spec = captioner.spec()
    assert (spec.backend, spec.model, spec.concurrency, spec.accelerator_type) == \
        ("vllm", "Qwen/Qwen3-VL-8B-Instruct", 8, "H200")
    assert spec.engine_kwargs == {"max_model_len": 8192, "gpu_memory_utilization": 0.9}
    assert (captioner.chunk_rows, captioner.backfill_cron) == (4096, "0 3 * * *")
    assert captioner.produced_version() == spec.version() == captioner.caption_version()
    bad = tmp_path / "bad.yaml"
    bad.write_text("- backend: vllm\n")
    with pytest.raises(ValueError, match=r"bad\.yaml: expected a mapping"):
        captioner_from_file(bad)
    assert captioner_from_file(tmp_path / "absent.yaml").spec() == CaptionerSpec()
