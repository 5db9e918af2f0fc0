"""A subset's own MDS tree: the selected samples copied out of their sources' current trees.

Why its own tree and not a skip-list view over the source trees: a fine-tuning subset is a
small share of the corpus (often well under 1 %). As a view, a trainer would stream every
shard of every source tree to read that share (on an object store, download 100x the bytes
it trains on), the view could only be read through our skip-aware dataset, and it would
break whenever a source tree is rewritten. Its own tree costs a copy of only the samples it
holds, streams with a plain `StreamingDataset(remote=<tree>/<tier>/<W>x<H>)`, and stays
valid as long as it is current. The samples' bytes are copied as stored (the pipeline's
Q92 JPEG is never decoded or re-encoded), each with its source's `license`.

Layout: `mds/subsets/<name>` is the subset's tree store, the same versioned trees and
current pointer as a source's (`TreeStore` under the `mds/subsets` root), with `tree.json`,
`card.json` and `card.md` beside the leaves.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from prx_assets.stages.shards.plan import DEFAULT_SIZE_LIMIT, MDS_COLUMNS
from prx_assets.storage.refs import Location
from prx_assets.storage.trees import (
    DEFAULT_RETENTION,
    TREE_MANIFEST,
    TreeStore,
    leaf_key,
    new_tree_version,
    read_index,
)

SUBSETS_DIR = "subsets"  # under the MDS root: mds/subsets/<name>
SUBSET_COLUMNS = dict(MDS_COLUMNS)  # the design's sample with its provenance columns
PROVENANCE_DEFAULTS = {"url": "", "license_url": "", "attribution": ""}


def subset_store(mds_root: Location, name: str,
                 log: Callable[[str], None] | None = None) -> TreeStore:
    """The subset's trees: a TreeStore under `mds/subsets`."""
    store = TreeStore(mds_root / SUBSETS_DIR, name, kind=SUBSETS_DIR)
    if log is not None:
        store.log = log
    return store


def split_sample(data: bytes, names: list[str], sizes: list[int | None]) -> dict[str, bytes]:
    """A stored MDS sample's bytes per column (variable-size columns' lengths first)."""
    lengths: list[int] = []
    at = 0
    for size in sizes:
        if size:
            lengths.append(size)
        else:
            lengths.append(int(np.frombuffer(data[at:at + 4], np.uint32)[0]))
            at += 4
    columns = {}
    for name, length in zip(names, lengths, strict=True):
        columns[name] = data[at:at + length]
        at += length
    return columns


class ShardSamples:
    """The samples of one stored shard, read once, each as its columns' raw bytes."""

    def __init__(self, leaf: Location, entry: dict):
        self.data = (leaf / entry["raw_data"]["basename"]).read_bytes()
        if entry.get("compression"):
            raise ValueError(f"{leaf}: compressed shards are not copied into subsets")
        self.names = entry["column_names"]
        self.encodings = dict(zip(entry["column_names"], entry["column_encodings"],
                                  strict=True))
        self.sizes = entry["column_sizes"]
        count = int(np.frombuffer(self.data[:4], np.uint32)[0])
        self.offsets = np.frombuffer(self.data[4:4 * (count + 2)], np.uint32)

    def sample(self, index: int) -> dict[str, Any]:
        """A writer-ready sample: the image's stored bytes as they are, the rest decoded."""
        from streaming.base.format.mds.encodings import mds_decode  # see write_leaf

        raw = split_sample(bytes(self.data[self.offsets[index]:self.offsets[index + 1]]),
                           self.names, self.sizes)
        return {name: value if self.encodings[name] == "jpeg"
                else mds_decode(self.encodings[name], value) for name, value in raw.items()}


@dataclass
class SubsetTreeReport:
    name: str
    tree_version: str
    path: str
    samples: int
    leaves: dict[str, int] = field(default_factory=dict)  # leaf -> samples
    bytes: int = 0
    per_source: Counter = field(default_factory=Counter)


def write_leaf(rows: pa.Table, out: Path, source_trees: Mapping[str, Location],
               licenses: Mapping[str, str], size_limit: int) -> None:
    """The rows' samples, in order, into an MDS leaf at the local folder `out`."""
    # Imported here: streaming pulls in torch and transformers (~5 s) for every process
    # that loads the definitions, most of which write no subset.
    from streaming import MDSWriter

    shards: dict[tuple[str, str, str], ShardSamples] = {}
    indexes: dict[tuple[str, str], dict[str, dict]] = {}
    with MDSWriter(out=str(out), columns=SUBSET_COLUMNS, size_limit=size_limit,
                   exist_ok=True) as writer:
        for source, leaf, shard, index in zip(*(rows.column(c).to_pylist() for c in
                                                ("source", "leaf", "shard", "sample_index")),
                                              strict=True):
            key = (source, leaf, shard)
            if key not in shards:
                leaf_dir = source_trees[source] / leaf
                if (source, leaf) not in indexes:
                    indexes[(source, leaf)] = {e["raw_data"]["basename"]: e
                                               for e in read_index(leaf_dir)}
                shards = {key: ShardSamples(leaf_dir, indexes[(source, leaf)][shard])}
            sample = shards[key].sample(int(index))
            # A source tree from before the provenance columns has none: empty, and the
            # source's license.
            writer.write({**PROVENANCE_DEFAULTS, **sample,
                          "license": sample.get("license") or licenses.get(source, "unknown")})


def build_subset_tree(store: TreeStore, rows: pa.Table, source_trees: Mapping[str, Location],
                      licenses: Mapping[str, str], manifest: dict,
                      write_card: Callable[[Location, SubsetTreeReport], None] | None = None,
                      size_limit: int = DEFAULT_SIZE_LIMIT,
                      retention: timedelta = DEFAULT_RETENTION) -> SubsetTreeReport:
    """Write the selected `rows` as a new version of the subset's tree, its manifest and
    card inside, then publish it if no other build published first (compare-and-swap;
    the previous version stays readable until then, and past it for `retention`)."""
    store.prepare()
    base = store.current_version()
    version = new_tree_version()
    staging = store.staging(version)
    rows = rows.sort_by([("tier", "ascending"), ("width", "ascending"),
                         ("height", "ascending"), ("source", "ascending"),
                         ("leaf", "ascending"), ("shard", "ascending"),
                         ("sample_index", "ascending")])
    report = SubsetTreeReport(store.source, version, "", rows.num_rows)
    report.per_source.update(rows.column("source").to_pylist())
    scratch = Path(tempfile.mkdtemp(prefix="prx-subset-"))
    try:
        staging.make_dirs()
        for name, leaf_rows in _by_leaf(rows):
            local = (staging / name).path if staging.is_local else scratch / name
            write_leaf(leaf_rows, local, source_trees, licenses, size_limit)
            if not staging.is_local:
                for file in sorted(local.iterdir()):
                    (staging / name / file.name).write_bytes(file.read_bytes())
            report.leaves[name] = leaf_rows.num_rows
            report.bytes += sum(e["raw_data"]["bytes"] for e in read_index(staging / name))
        if write_card is not None:
            write_card(staging, report)
        (staging / TREE_MANIFEST).write_text(json.dumps(
            {**manifest, "subset": store.source, "tree_version": version,
             "samples": rows.num_rows, "leaves": report.leaves, "columns": SUBSET_COLUMNS},
            indent=2, sort_keys=True, default=str))
        final = store.finish(version)
    except BaseException:
        staging.delete()
        raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    store.publish(version, expected=base)
    store.prune(retention)
    report.path = str(final.path if final.is_local else final.uri)
    return report


def _by_leaf(rows: pa.Table) -> list[tuple[str, pa.Table]]:
    """Rows grouped by the subset's leaf `<tier>/<W>x<H>` (sources of one shape share it)."""
    names = [f"{t}/{w}x{h}" for t, w, h in zip(rows.column("tier").to_pylist(),
                                               rows.column("width").to_pylist(),
                                               rows.column("height").to_pylist(), strict=True)]
    groups: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        groups.setdefault(name, []).append(i)
    return [(name, rows.take(pa.array(idx))) for name, idx in
            sorted(groups.items(), key=lambda item: leaf_key(item[0]))]
