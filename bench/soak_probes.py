"""What the soak watches beside its runs: a trainer streaming a tree under a reader lease,
the bytes on disk (each inode once) or in the bucket (each object), and the Ray workers of
its embedded Ray."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from pathlib import Path


class Trainer:
    """A fresh loader of one tier of one source, streamed epoch after epoch in a thread of
    its own until `stop()`: a training run beside the factory. Its reader lease (the
    loader's) outlives `stop()` until `leases.release()`."""

    PAUSE_S = 1.0  # between epochs: a few-sample epoch would otherwise spin a core

    def __init__(self, mds_root, source: str, tier: int, tree,
                 cache_dir: Path | None = None) -> None:
        import threading

        from prx_assets.loader import build_dataset

        self.source, self.tier, self.tree = source, tier, tree
        self.dataset = build_dataset(mds_root, tier, 1, weights={source: 1.0},
                                     shuffle=False, decode_images=False, cache_dir=cache_dir)
        self.leases = self.dataset.reader_leases
        self.epochs: list[list[str]] = []
        self.error: BaseException | None = None
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.stream, name="soak-trainer", daemon=True)
        self.thread.start()

    def stream(self) -> None:
        try:
            while True:
                self.epochs.append([sample["id"] for sample in self.dataset])
                if self.stopping.wait(self.PAUSE_S):
                    return
        except Exception as exc:  # a trainer must never error: the check reports it
            self.error = exc

    def problem(self, epochs: list[list[str]]) -> str | None:
        """What went wrong in the epochs `stop()` returned: an error, a sample twice in an
        epoch, an epoch of other samples than the first; None when nothing did."""
        name = f"the trainer on {self.source} tier {self.tier} (tree {self.tree.name})"
        if self.error is not None:
            return (f"{name} failed after {len(epochs)} epoch(s): "
                    f"{type(self.error).__name__}: {self.error}")
        for number, ids in enumerate(epochs):
            if len(ids) != len(set(ids)):
                return f"{name}: a sample twice in epoch {number}"
            if set(ids) != set(epochs[0]):
                return (f"{name}: epoch {number} streamed other samples than epoch 0: "
                        f"{sorted(set(ids) ^ set(epochs[0]))[:5]}")
        return None

    def stop(self) -> list[list[str]]:
        """The epochs streamed (at least one: the epoch under way is finished)."""
        self.stopping.set()
        self.thread.join()
        del self.dataset
        return self.epochs


def inode_bytes(folders: list[Path]) -> dict[tuple[int, int], int]:
    """Bytes of every file under the folders, each inode once (hard links shared)."""
    found: dict[tuple[int, int], int] = {}
    for folder in folders:
        for path in folder.rglob("*"):
            with contextlib.suppress(FileNotFoundError):
                stat = path.lstat()
                if path.is_file() and not path.is_symlink():
                    found[(stat.st_dev, stat.st_ino)] = stat.st_size
    return found


def version_bytes(sizes: Mapping[str, int], live: Iterable[str]) -> tuple[int, int]:
    """(all bytes, bytes of the `live` versions) of a source's trees folder in a bucket,
    listed as path -> size (`<version>/<tier>/<W>x<H>/<file>`, and the folder's own files):
    S3 has no hard links, a file carried into a version is a copy of its own, so every
    object counts."""
    live = set(live)
    return (sum(sizes.values()),
            sum(size for path, size in sizes.items() if path.split("/", 1)[0] in live))


def listed_versions(sizes: Mapping[str, int]) -> set[str]:
    """The versions (first folders) that hold a file in a trees folder's listing (path ->
    size): the versions a bucket stores, whatever empty prefixes it still lists."""
    return {path.split("/", 1)[0] for path in sizes if "/" in path}


def ray_workers() -> list[tuple[int, str]]:
    """(pid, title) of the Ray worker processes (`ray::...`) of this process's embedded Ray
    (its raylet's children): the soak's, not another Ray on the machine."""
    import psutil

    found = []
    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            cmdline = proc.cmdline()
            if cmdline and cmdline[0].startswith("ray::"):
                found.append((proc.pid, cmdline[0]))
    return found


def step_retries(instance, run_id: str) -> int:
    """Steps Dagster ran again in a run (`RetryRequested`: a transient failure)."""
    from dagster import DagsterEventType

    return len(instance.get_records_for_run(
        run_id, of_type=DagsterEventType.STEP_UP_FOR_RETRY).records)


def failure_cause(instance, run_id: str) -> str:
    """The first failed step of a run and the first line of the error it raised (Dagster's
    wrapper left out; "" when no step failed: a run killed before any did)."""
    from dagster import DagsterEventType

    records = instance.get_records_for_run(run_id, of_type=DagsterEventType.STEP_FAILURE).records
    for record in records:
        event = record.event_log_entry.dagster_event
        error = event.step_failure_data.error if event and event.step_failure_data else None
        while error is not None and error.cause is not None:  # the step's own error
            error = error.cause
        if event is not None and error is not None:
            lines = (error.message or "").strip().splitlines() or [error.cls_name]
            return f"{event.step_key}: {lines[0][:200]}"
    return ""
