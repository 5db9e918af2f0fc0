"""The GPU stack's resolution: the vLLM that Ray's llm extra names, the overrides, and a
resolver dry run for Linux x86-64 from registry metadata (uv; nothing is downloaded beyond
metadata, nothing installed)."""

import subprocess

import pytest

from prx_assets.models import gpu_stack
from prx_assets.models.gpu_stack import (
    OVERRIDES,
    StackError,
    check,
    main,
    named_vllm,
    overrides_text,
    parse_pins,
    pip_index_args,
)


def test_the_vllm_is_the_one_rays_llm_extra_names(monkeypatch):
    monkeypatch.setattr(gpu_stack.importlib.metadata, "requires", lambda name: [
        'vllm>=0.1; extra == "other"', 'aiohttp; extra == "llm"',
        'vllm[audio]==9.9.0; extra == "llm"'])
    assert named_vllm() == "vllm[audio]==9.9.0"
    monkeypatch.setattr(gpu_stack.importlib.metadata, "requires", lambda name: ["aiohttp"])
    with pytest.raises(StackError, match="names no vllm"):
        named_vllm()


def test_compiled_pins_are_read_with_extras_and_markers_and_canonical_names():
    text = ("ray[llm]==2.60.0\nTorch_Audio==2.11.0 ; sys_platform == 'linux'\n"
            "    # via vllm\n-e file:///repo\nnumpy==2.3.0\n")
    assert parse_pins(text) == {"ray": "2.60.0", "torch-audio": "2.11.0", "numpy": "2.3.0"}


def test_each_override_carries_its_reason():
    pins = {"torch": "2.13.0", "torchvision": "0.28.0", "transformers": "5.25.0"}
    lines = overrides_text(pins).splitlines()
    assert [line.split("  # ")[0] for line in lines] == [
        "torch==2.13.0", "torchvision==0.28.0", "transformers==5.25.0"]
    assert all(line.split("  # ")[1] == OVERRIDES[line.split("==")[0]] for line in lines)
    assert overrides_text(pins, ["transformers"]).startswith("transformers==5.25.0  # ")


def test_pips_indexes_and_wheel_folders_become_uv_arguments(monkeypatch):
    listed = (":env:.find-links='/opt/wheels'\nglobal.cert='/etc/ssl/certs/ca.crt'\n"
              "global.constraint='/etc/pip/constraints.txt'\n"
              "global.extra-index-url='file:///a/simple file:///b/simple'\n"
              "global.find-links='/opt/wheels'\n")
    monkeypatch.setattr(gpu_stack.subprocess, "run", lambda *a, **k: subprocess.
                        CompletedProcess(a, 0, stdout=listed))
    assert pip_index_args() == [
        "--find-links", "/opt/wheels", "--constraint", "/etc/pip/constraints.txt",
        "--extra-index-url", "file:///a/simple", "--extra-index-url", "file:///b/simple",
        "--index-strategy", "unsafe-best-match"]
    monkeypatch.setattr(gpu_stack.subprocess, "run", lambda *a, **k: subprocess.
                        CompletedProcess(a, 0, stdout=""))
    assert pip_index_args() == []


def test_the_gpu_stack_resolves_for_linux_x86_64_from_metadata():
    summary = check()
    assert f"{named_vllm()} (named by ray[llm]==" in summary
    for name in OVERRIDES:  # each at the GPU stack's version, the reason beside it
        assert f"  {name} " in summary and OVERRIDES[name] in summary
    assert "mosaicml-streaming 0.13" in summary  # beside transformers 5, by the override


def test_a_conflicting_pin_fails_naming_both_pins(capsys):
    assert main(["check", "--with", "vllm==0.23.0"]) == 1
    error = capsys.readouterr().err
    assert "the GPU stack does not resolve for x86_64-manylinux_2_28" in error
    assert "vllm==0.23.0" in error and named_vllm() in error
