"""Named failpoints: places where a stage can be held still mid-work, so a fault test kills
it at a known point instead of racing the run.

A stage calls `failpoint("<stage>.<point>")` where it has something half-written. Nothing
happens unless the process was started with

    PRX_FAILPOINT=<name>[,<name>...]    the points that are armed
    PRX_FAILPOINT_FILE=<path>           the marker file the test waits for

Then the first process to reach an armed point creates the marker (atomically, holding
`{"failpoint", "pid", "module"}`) and blocks there until it is killed. Every later hit, in
any process, finds the marker and passes through: a Ray task retried after its worker was
killed at the point then runs to the end. The marker names the blocked process, so a test
can kill exactly that one (a Ray worker) or the run's whole process group.

A point can also be armed as a *barrier*, to line up several processes at one place (two
writers committing to one table at once):

    PRX_BARRIER=<name>[,<name>...]      the points that wait
    PRX_BARRIER_DIR=<path>              the folder of ready files and the release file

Each process reaching an armed barrier writes `<name>.<pid>.ready` there and waits until
`<name>.released` exists (the test creates it once every process is ready); after the
release, every later hit passes through.

The variables are read once, when this module is imported; an unarmed point costs one
set-membership test. Embedded Ray workers inherit the driver's environment; for a cluster
(`RAY_ADDRESS`) `ray_runtime.connect` forwards these variables in the job's runtime env.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

ENV_POINTS = "PRX_FAILPOINT"
ENV_MARKER = "PRX_FAILPOINT_FILE"
ENV_BARRIERS = "PRX_BARRIER"
ENV_BARRIER_DIR = "PRX_BARRIER_DIR"

# Every failpoint a stage calls, and where it holds the stage.
POINTS = {
    "ingest.expand_units": "a Ray task expanding ingest units, after yielding a block of rows "
                           "(units listed, that block not committed)",
    "ingest.chunk_committed": "the ingest driver, right after a chunk's merge-insert into "
                              "raw_images committed (more units pending)",
    "images.bucket_batch": "a Ray task of the image stage, a batch resized but not yet handed "
                           "to the writer",
    "images.chunk_committed": "the image stage's driver, right after a chunk of bucketed_images "
                              "(and its phashes) committed",
    "captions.chunk_committed": "the captions driver, right after a chunk's merge-insert "
                                "committed (before compaction)",
    "labels.chunk_committed": "the labels driver, right after a chunk of caption_labels "
                              "committed (more captions pending)",
    "attributes.chunk_committed": "the attributes driver, right after a chunk of attributes "
                                  "committed (more captions pending)",
    "storage.copies_found": "a writer repairing keys two writers both committed, the later "
                            "copies found by key and not yet deleted",
    "mds.write_part": "a Ray task writing an MDS part inside the `.partial` tree, after its "
                      "first samples",
    "leases.waiting": "a writer that found its lease held by a live owner, before it waits "
                      "(logged once per holder)",
    "mds.before_mapping_commit": "the mds_shards driver of a full build planned in groups, "
                                 "its version complete and its mapping fragments staged, "
                                 "before their one commit",
    "mds.before_publish": "the mds_shards driver, its version complete and its mapping "
                          "committed, before the compare-and-swap of the pointer",
    "skip_lists.before_publish": "the skip-lists driver on local disk, its lists computed, "
                                 "before it replaces the sidecars in place",
    "skip_lists.before_version_publish": "the skip-lists driver on an object store, its new "
                                         "version staged, before the pointer's swap",
    "skip_lists.sidecar_written": "the skip-lists driver, right after one sidecar was "
                                  "replaced (others still old)",
    "skip_lists.sidecar_staged": "the skip-lists driver on an object store, right after one "
                                 "sidecar of the new version was written (pointer not moved)",
    "storage.upsert_uncommitted": "an upsert (a chunk of a chunked run) after its merge "
                                  "wrote its data files, before the commit",
    "storage.replace_uncommitted": "a replacement of some rows (`replace_where`: a source's "
                                   "corpus rows) with its new files and deletion files "
                                   "written, before its one commit",
    "semdedup.clusters_committed": "a full SemDeDup run, semantic_clusters committed (its "
                                   "fit forgotten), semantic_duplicates not yet",
    "semdedup.duplicates_merged": "a SemDeDup update, semantic_duplicates merged, "
                                  "semantic_clusters and the fit's record not yet",
    "storage.overwrite_uncommitted": "the driver of a whole-table write "
                                     "(write_dataset_atomically), every fragment written, "
                                     "before the commit",
}

_ARMED = frozenset(name for name in os.environ.get(ENV_POINTS, "").split(",") if name)
_MARKER = os.environ.get(ENV_MARKER) or None
_BARRIERS = frozenset(name for name in os.environ.get(ENV_BARRIERS, "").split(",") if name)
_BARRIER_DIR = os.environ.get(ENV_BARRIER_DIR) or None


def failpoint(name: str) -> None:
    """Hold this process here forever if `name` is armed and has not fired yet; wait for
    the release if `name` is armed as a barrier."""
    if name in _ARMED:
        _hold(name)
    if name in _BARRIERS:
        _wait_for_release(name)


def _known(names: str | list[str]) -> list[str]:
    """`names` as a list, refused if one is not a point a stage calls (a typo never arms)."""
    names = [names] if isinstance(names, str) else list(names)
    unknown = [n for n in names if n not in POINTS]
    if unknown:
        raise ValueError(f"unknown failpoint(s) {unknown}; known: {sorted(POINTS)}")
    return names


def env(names: str | list[str], marker: Path) -> dict[str, str]:
    """The environment variables that arm `names` with `marker` (for a test's subprocess)."""
    return {ENV_POINTS: ",".join(_known(names)), ENV_MARKER: str(marker)}


def barrier_env(names: str | list[str], folder: Path) -> dict[str, str]:
    """The environment variables that arm `names` as barriers in `folder`."""
    return {ENV_BARRIERS: ",".join(_known(names)), ENV_BARRIER_DIR: str(folder)}


def ready_at_barrier(folder: Path, name: str) -> list[int]:
    """The pids waiting at (or released from) barrier `name` in `folder`."""
    return sorted(int(p.name.split(".")[-2]) for p in Path(folder).glob(f"{name}.*.ready"))


def release_barrier(folder: Path, name: str) -> None:
    (Path(folder) / f"{name}.released").touch()


def forwarded_env() -> dict[str, str]:
    """This process's failpoint variables, for a Ray runtime env (empty when unarmed)."""
    return {k: os.environ[k] for k in (ENV_POINTS, ENV_MARKER, ENV_BARRIERS, ENV_BARRIER_DIR)
            if os.environ.get(k)}


def read_marker(marker: Path) -> dict | None:
    """The marker's content, or None while no process has reached the point."""
    try:
        return json.loads(Path(marker).read_text())
    except FileNotFoundError:
        return None


def _hold(name: str) -> None:
    if _MARKER is None:
        raise RuntimeError(f"failpoint {name!r} is armed by {ENV_POINTS} but {ENV_MARKER} "
                           "is not set")
    marker = Path(_MARKER)
    if marker.exists():
        return  # fired once already: pass through
    body = json.dumps({"failpoint": name, "pid": os.getpid(), "module": __file__})
    # Written aside, then hard-linked into place: the link fails if the marker exists, so
    # exactly one process holds, and a reader never sees a half-written marker.
    temporary = marker.with_name(f".{marker.name}.{os.getpid()}.{threading.get_ident()}")
    temporary.write_text(body)
    try:
        os.link(temporary, marker)
    except FileExistsError:
        return
    finally:
        temporary.unlink(missing_ok=True)
    while True:
        time.sleep(3600)


def _wait_for_release(name: str) -> None:
    if _BARRIER_DIR is None:
        raise RuntimeError(f"barrier {name!r} is armed by {ENV_BARRIERS} but {ENV_BARRIER_DIR} "
                           "is not set")
    folder = Path(_BARRIER_DIR)
    released = folder / f"{name}.released"
    if released.exists():
        return
    (folder / f"{name}.{os.getpid()}.ready").write_text(json.dumps({"barrier": name}))
    while not released.exists():  # the test's signal, however long the others take
        time.sleep(0.01)
