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


def test_a_finished_version_has_its_files_on_disk_before_its_rename(tmp_path, monkeypatch):
    """Indexes, shards (written plainly by the part tasks), sidecars and the folders holding
    them are flushed before the rename that completes the version."""
    from prx_assets.storage.refs import Location
    from prx_assets.storage.trees import INDEX, TreeStore

    store = TreeStore(Location(str(tmp_path / "mds")), "src")
    staged = store.staging("v1").path
    leaf_files = (INDEX, "shard.00000.mds", "shard.00000.skip.json")
    for leaf in ("512/512x512", "1024/1024x1024"):
        (staged / leaf).mkdir(parents=True)
        for name in leaf_files:
            (staged / leaf / name).write_text("{}")
    published = tmp_path / "published.mds"  # a flushed tree's shard, carried by a hard link
    published.write_text("{}")
    os.link(published, staged / "512/512x512/shard.00001.mds")
    events: list[str] = []
    fsync, rename = os.fsync, os.rename
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(os.readlink(f"/proc/self/fd/{fd}")),
                                                 fsync(fd))[1])
    monkeypatch.setattr(os, "rename", lambda a, b: (events.append("rename"), rename(a, b))[1])
    store.finish("v1")
    flushed = set(events[:events.index("rename")])
    for leaf in ("512/512x512", "1024/1024x1024"):
        assert {str(staged / leaf / name) for name in leaf_files} <= flushed
        assert {str(staged / leaf), str(staged / leaf.split("/")[0]), str(staged)} <= flushed
    assert str(staged / "512/512x512/shard.00001.mds") not in flushed
    assert events[events.index("rename") + 1:] == [str(store.trees_dir.path)]
