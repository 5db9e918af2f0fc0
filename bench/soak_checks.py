"""The soak's invariants, checked after every cycle against its model of the sources
(`docs/factory.md`, "The soak"): each a function of the soak's state, raising its
`Violation`."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING

from bench.soak_probes import (
    Trainer,
    inode_bytes,
    listed_versions,
    ray_workers,
    version_bytes,
)
from bench.soak_sources import ModelSource

if TYPE_CHECKING:
    from bench.soak import Soak

KEYS = {"raw_images": ["id"], "bucketed_images": ["id"], "phashes": ["id"],
        "mds_samples": ["id"], "captions": ["id", "caption_version"]}
DISK_SLACK = 1.2


def check_cycle(state: Soak, trainer: Trainer | None) -> None:
    from prx_assets.stages.shards import verify

    if trainer is not None:
        _trainer(state, trainer)
        _leased_tree(state, trainer.tree)
        state.leased.setdefault(trainer.source, set()).add(trainer.tree.name)
    for source in state.sources:
        checks, problems = verify.verify_tree(state.storage, source.name)
        if problems or not all(c.ok for c in checks):
            raise state.violation(f"{source.name}: the current tree is not whole: "
                                 f"{problems} {[c for c in checks if not c.ok]}")
        _unique_keys(state, source.name)
        _tree_model(state, source)
        for guarded in (True, False):
            _loader(state, source, guarded)
        state.leased.setdefault(source.name, set())
        _disk(state, source.name)
    if trainer is not None and trainer.leases is not None:
        trainer.leases.release()
    _no_credentials(state)


def _trainer(state: Soak, trainer: Trainer) -> None:
    """The trainer streamed throughout the runs without an error, no sample twice in an
    epoch, every epoch the same samples (its tree, leased, does not change)."""
    epochs = trainer.stop()
    problem = trainer.problem(epochs)
    if problem:
        raise state.violation(problem)
    state.note(f"trainer: {len(epochs)} epoch(s) of {len(epochs[0]) if epochs else 0} "
              "sample(s)")


def _leased_tree(state: Soak, tree) -> None:
    """Every shard the leased tree's indexes list is still there, of its size (and
    hash, where an index records one)."""
    from prx_assets.storage.trees import leaf_names, read_index, shard_problems

    for leaf in leaf_names(tree):
        problems = shard_problems(tree / leaf, read_index(tree / leaf))
        if problems:
            raise state.violation(f"tree {tree.name} under a reader lease lost shards: "
                                 f"{problems[:5]}")


def _unique_keys(state: Soak, source: str) -> None:
    import pyarrow.compute as pc

    from prx_assets.storage.keyed_writes import key_strings

    for table, keys in KEYS.items():
        ref = state.storage.table(table, source)
        if not ref.exists():
            continue
        rows = ref.to_table(columns=keys)
        strings = key_strings(rows, keys)
        if pc.count_distinct(strings).as_py() != rows.num_rows:
            raise state.violation(f"{table}[{source}] holds a key twice")


def _tree_model(state: Soak, source: ModelSource) -> None:
    """The tree's mapping names exactly the model's samples: every image the source
    holds now (its runs succeeded), and nothing it no longer holds."""
    from prx_assets.storage.tables import MDS_SAMPLES

    mapped = set(state.storage.table(MDS_SAMPLES, source.name)
                 .to_table(columns=["id"])["id"].to_pylist())
    expected = set(source.expected())
    if mapped != expected:
        raise state.violation(
            f"{source.name}: the tree's samples differ from the source's: missing "
            f"{sorted(expected - mapped)[:5]}, not in the source "
            f"{sorted(mapped - expected)[:5]}")


def _loader(state: Soak, source: ModelSource, guarded: bool) -> None:
    """A fresh loader of every tier streams the model's samples less the opted-out,
    each once, each with the active captioner's caption."""
    from prx_assets.loader import build_dataset
    from prx_assets.storage.trees import leaf_names, source_trees
    from prx_assets.testing.shared_memory import release_shared_memory

    tree = source_trees(state.storage.mds_root, source.name).current_tree()
    expected = source.expected()
    streamed: dict[str, str] = {}
    how = "with" if guarded else "without"
    for tier in sorted({int(name.split("/")[0]) for name in leaf_names(tree)}):
        release_shared_memory(state.root)
        dataset = build_dataset(state.storage.mds_root, tier, 1,
                                weights={source.name: 1.0}, shuffle=False,
                                decode_images=False, guard_opt_outs=guarded,
                                cache_dir=state.cache_dir)
        try:
            seen = [(sample["id"], sample["caption"]) for sample in dataset]
        except Exception as exc:  # a trainer's fresh loader must never error
            raise state.violation(f"{source.name} tier {tier}: a fresh loader ({how} its "
                                 f"guard) failed: {type(exc).__name__}: {exc}") from exc
        finally:
            if dataset.reader_leases is not None:  # build_dataset sets it; typed optional
                dataset.reader_leases.release()
            del dataset
            release_shared_memory(state.root)
        ids = [i for i, _ in seen]
        if len(ids) != len(set(ids)):
            raise state.violation(f"{source.name} tier {tier}: a sample twice in one epoch")
        streamed.update(seen)
    if state.opted & set(streamed):
        raise state.violation(f"{source.name}: opted-out {sorted(state.opted & set(streamed))}"
                             f" streamed ({how} the loader's guard)")
    captions = {i: state.model_caption() if state.captioner_version else text
                for i, text in expected.items()}
    wanted = set(expected) - state.opted - label_skipped(state, captions)
    if set(streamed) != wanted:
        raise state.violation(
            f"{source.name}: a loader ({how} its guard) streams other samples than the "
            f"source's kept ones: missing {sorted(wanted - set(streamed))[:5]}, extra "
            f"{sorted(set(streamed) - wanted)[:5]}")
    wrong = sorted(i for i, text in streamed.items() if text != captions[i])
    if wrong:
        raise state.violation(f"{source.name}: {len(wrong)} sample(s) streamed with another "
                             f"caption than the active captioner's, e.g. {wrong[0]}: "
                             f"{streamed[wrong[0]]!r} for {captions[wrong[0]]!r}")


def label_skipped(state: Soak, captions: dict[str, str]) -> set[str]:
    """The ids whose caption (id -> caption) the labels stage's classifier gives a label
    skip_lists skips by default (`text`, `nsfw`): in the tree, never streamed."""
    import pyarrow as pa

    from prx_assets.defs.skip_lists import SkipListsConfig
    from prx_assets.stages.labels.labels import EmbeddedLabeler

    new = sorted(set(captions.values()) - set(state.labels))
    if new:
        rows = pa.table({"id": new, "caption": new, "caption_version": ["soak"] * len(new)})
        labelled = EmbeddedLabeler("soak")(rows)
        state.labels.update(zip(new, labelled.column("label").to_pylist(), strict=True))
    skipped = set(SkipListsConfig().skip_labels)
    return {i for i, text in captions.items() if state.labels[text] in skipped}


def _disk(state: Soak, source: str) -> None:
    """Retention ran (0 days, at every publish): the only tree versions left are the
    current one and ones a reader leased (kept until a publish after the lease ends),
    and they hold at most DISK_SLACK times the bytes of the live ones (files a version
    carried from another are hard links, counted once; in a bucket every object counts,
    from one listing of the trees' prefix)."""
    from prx_assets.storage.trees import source_trees

    store = source_trees(state.storage.mds_root, source)
    current = store.current_version()
    if current is None:  # verify_tree passed: a current tree is there
        raise state.violation(f"{source}: no current tree version")
    live_versions = {current} | state.leased[source]
    if store.is_local:
        stored = set(store.trees_dir.folders())
    else:  # versions by their objects: a store may list an emptied prefix a while
        sizes = store.trees_dir.files_below()
        stored = listed_versions(sizes)
    kept = sorted(stored - live_versions)
    if kept:
        raise state.violation(f"{source}: tree versions {kept} outlived retention (0 days): "
                             f"neither current ({current}) nor ever leased")
    if store.is_local:
        live = [store.tree(v).path for v in live_versions if store.tree(v).path.exists()]
        total = sum(inode_bytes([store.trees_dir.path]).values())
        live_bytes = sum(inode_bytes(live).values())
    else:
        total, live_bytes = version_bytes(sizes, live_versions)
    if total > DISK_SLACK * live_bytes:
        raise state.violation(
            f"{source}: its tree versions take {total:,} bytes on disk, more than "
            f"{DISK_SLACK}x the {live_bytes:,} of the live ones")


def _no_credentials(state: Soak) -> None:
    needles = [value.encode() for value in state.secrets()]
    local = [state.home, state.logs] + ([state.data_root] if state.storage.is_local else [])
    for top in local:
        for path in top.rglob("*"):
            if path.is_file() and not path.is_symlink():
                data = path.read_bytes()
                if any(n in data for n in needles):
                    raise state.violation(f"a credential value in {path}")
    if not state.storage.is_local:  # every object under the data root in the bucket
        root = state.storage.location()
        for name in root.files_below():
            with contextlib.suppress(FileNotFoundError):  # a lease let go meanwhile
                if any(n in (root / name).read_bytes() for n in needles):
                    raise state.violation(f"a credential value in {root / name}")
    for pid, title in ray_workers():
        with contextlib.suppress(OSError):
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            if any(n in environ for n in needles):
                raise state.violation(f"a credential value in the environment of Ray "
                                     f"worker {pid} ({title})")
