"""Resolving a tree is light: a trainer's loader, the browser and `prx-assets mds-uri` find
the current tree and read its indexes and sidecars without importing Ray or the writer."""

import json
import os
import subprocess
import sys

import pytest

_IMPORTED = """
import importlib, json, sys
importlib.import_module(sys.argv[1])
print(json.dumps(sorted(m for m in ("ray", "streaming", "streaming.base.format.mds.writer")
                        if m in sys.modules)))
"""


def _heavy_imports(module: str) -> list[str]:
    """What of Ray and mosaicml-streaming importing `module` alone pulls in."""
    done = subprocess.run([sys.executable, "-c", _IMPORTED, module], check=True,
                          capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", ["prx_assets.storage.trees", "prx_assets.storage.sidecars",
                                    "prx_assets.stages.skip_lists.skip_lists"])
def test_tree_resolution_and_sidecars_import_neither_ray_nor_streaming(module):
    assert _heavy_imports(module) == []


def test_the_loader_does_not_import_ray():
    assert "ray" not in _heavy_imports("prx_assets.loader")
