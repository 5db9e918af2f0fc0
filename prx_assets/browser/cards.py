"""The cards of the published trees (every source's and every subset's), for the browser:
which trees have one, and one card read back (its JSON and Markdown)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prx_assets.stages.shards.card import CARD_MD, read_card
from prx_assets.stages.skip_lists.skip_lists import SkipTally, tree_skips
from prx_assets.stages.subsets.tree import SUBSETS_DIR
from prx_assets.storage.layout import Storage
from prx_assets.storage.trees import TREES_DIR, TreeStore

KINDS = ("source", "subset")


@dataclass(frozen=True)
class TreeCard:
    kind: str
    name: str
    card: dict | None
    markdown: str
    # What the tree's sidecars skip now (the card's own section is as of its build, before
    # the skip lists of the source were written): by default, and the opt-in lists apart.
    skips: SkipTally = field(default_factory=SkipTally)

    @property
    def samples(self) -> int | None:
        return self.card.get("samples") if self.card else None


def _store(storage: Storage, kind: str, name: str) -> TreeStore:
    root = storage.mds_root / SUBSETS_DIR if kind == "subset" else storage.mds_root
    return TreeStore(root, name)


def published(storage: Storage) -> list[tuple[str, str]]:
    """(kind, name) of every tree with a current version, sources first."""
    found = []
    for kind, root in (("source", storage.mds_root), ("subset", storage.mds_root / SUBSETS_DIR)):
        trees = root / TREES_DIR
        if not trees.exists():
            continue
        found += [(kind, name) for name in trees.folders()
                  if TreeStore(root, name).current_version() is not None]
    return found


def tree_card(storage: Storage, kind: str, name: str) -> TreeCard | None:
    """The current tree's card; None when there is no such tree (a tree published before
    cards existed has a TreeCard without one)."""
    if kind not in KINDS:
        return None
    store = _store(storage, kind, name)
    if store.current_version() is None:
        return None
    tree = store.current_tree()
    try:
        markdown = (tree / CARD_MD).read_text()
    except FileNotFoundError:
        markdown = ""
    return TreeCard(kind, name, read_card(tree), markdown, tree_skips(tree))
