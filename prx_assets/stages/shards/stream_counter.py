"""Samples per MDS leaf as a plain `streaming.StreamingDataset` counts them, from a child
process that is spawned once per process and then serves every count asked of it.

Why a child: every StreamingDataset creates shared-memory segments and keeps descriptors
open until its process ends, so a long-lived process (a Dagster run, a trainer's launcher,
a test worker) must not build them itself. Why one kept child rather than one per count:
the child's start (a fresh interpreter importing torch through streaming) costs seconds of
CPU, paid by every `leaves_stream` check after a build; a kept child pays it once.

What a count depends on is handed over with every request: the leaves (absolute local
paths) and the caller's environment as it is at that moment (streaming reads its world from
it). Nothing else of the caller's state reaches the child, which is why it is spawned, not
forked (a fork server started earlier kept the state of that moment). After each count the
child releases the dataset's segments, and it is replaced after `REQUESTS_PER_CHILD` counts
so nothing it may still hold grows without bound.

A Pool is not used: leaving it terminates its worker with SIGTERM, which the worker may
ignore once streaming is imported, and `terminate()` then waits for it forever. The child
here ends when its pipe closes (at the caller's exit or on replacement); one that lingers is
killed.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import importlib.util
import multiprocessing
import os
import sys
import threading
import types
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from prx_assets.engine.shm_prefix import claiming_prefix

CHILD_EXIT_WAIT_S = 60  # how long a child whose pipe closed may take to exit before it is killed
REQUESTS_PER_CHILD = 64  # counts one child serves before a fresh one replaces it


class StreamCounter:
    """The kept child of this process (started on first use, replaced when it dies, after
    `REQUESTS_PER_CHILD` counts, or in a forked copy of the process)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._child: BaseProcess | None = None
        self._pipe: Connection | None = None
        self._served = 0

    @property
    def pid(self) -> int | None:
        """The kept child's process id, None before the first count."""
        return None if self._child is None else self._child.pid

    def forget_after_fork(self) -> None:
        """In a forked copy of the process: the child and its pipe are the parent's, and the
        lock may have been held by a thread the copy does not have."""
        self._lock = threading.Lock()
        self._child, self._pipe, self._served = None, None, 0

    def counts(self, leaves: list[str]) -> list[int]:
        """Samples per local leaf as one StreamingDataset (a stream per leaf) sees them.
        An error in the child comes back raised here, with its message; a child that died
        is replaced and asked once more."""
        request = ([os.path.abspath(leaf) for leaf in leaves], dict(os.environ))
        with self._lock:
            for attempt in (1, 2):
                pipe = self._ready_pipe()
                try:
                    pipe.send(request)
                    answer = pipe.recv()
                except (EOFError, OSError):
                    code = self._stop()
                    if attempt == 2:
                        raise RuntimeError("the StreamingDataset count process died before "
                                           f"answering (exit code {code})") from None
                    continue
                self._served += 1
                if self._served >= REQUESTS_PER_CHILD:
                    self._stop()
                break
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _ready_pipe(self) -> Connection:
        if self._pipe is None or self._child is None or not self._child.is_alive():
            self._stop()
            self._start()
        assert self._pipe is not None
        return self._pipe

    def _start(self) -> None:
        context = multiprocessing.get_context("spawn")
        ours, theirs = context.Pipe(duplex=True)
        child = context.Process(target=serve_counts, args=(theirs,), daemon=True,
                                name="prx-stream-counter")
        child.start()
        theirs.close()
        self._child, self._pipe, self._served = child, ours, 0

    def _stop(self) -> int | None:
        """Close the pipe (the child's signal to exit), wait for it, kill one that lingers;
        the child's exit code."""
        child, pipe = self._child, self._pipe
        self._child, self._pipe, self._served = None, None, 0
        if pipe is not None:
            pipe.close()
        if child is None:
            return None
        child.join(timeout=CHILD_EXIT_WAIT_S)
        if child.is_alive():
            child.kill()
            child.join()
        return child.exitcode


_COUNTER = StreamCounter()
os.register_at_fork(after_in_child=_COUNTER.forget_after_fork)
# Registered after multiprocessing's own exit hook, so it runs first (atexit is last in,
# first out): the child leaves on its closed pipe instead of a SIGTERM it may ignore.
atexit.register(_COUNTER.close)


def streamed_counts(leaves: list[str]) -> list[int]:
    """Samples per local leaf as one plain StreamingDataset (a stream per leaf) sees them."""
    return _COUNTER.counts(leaves)


def serve_counts(pipe: Connection) -> None:
    """The child's loop: a count per request until the pipe closes."""
    while True:
        try:
            leaves, environ = pipe.recv()
        except EOFError:
            return
        os.environ.clear()
        os.environ.update(environ)
        try:
            answer: object = count_in_this_process(leaves)
        except BaseException as exc:  # sent back and raised in the caller, with its message
            answer = exc
        try:
            pipe.send(answer)
        except Exception:  # an error that does not pickle still comes back, as its text
            pipe.send(RuntimeError(f"{type(answer).__name__}: {answer}"))


def count_in_this_process(leaves: list[str]) -> list[int]:
    """The counts from a StreamingDataset built here, its shared memory released after."""
    stream_class, dataset_class = streaming_dataset_classes()
    dataset = claiming_prefix(lambda: dataset_class(
        streams=[stream_class(local=leaf) for leaf in leaves], batch_size=1, shuffle=False))
    try:
        return [int(n) for n in dataset.samples_per_stream]
    finally:
        del dataset
        release_own_segments()


def release_own_segments() -> None:
    """Unlink and close every segment streaming's handles in this process hold (the child's
    datasets are gone by then); one whose buffer is still in use is left to the child's exit."""
    from streaming.base.shared.memory import SharedMemory

    gc.collect()
    for handle in [o for o in gc.get_objects() if type(o) is SharedMemory]:
        try:
            handle.cleanup()
        except BufferError:
            continue
        handle.created_shms, handle.opened_shms = [], []
        atexit.unregister(handle.cleanup)


def streaming_dataset_classes() -> tuple[type, type]:
    """streaming's `Stream` and `StreamingDataset`, from their own modules (the same classes
    `from streaming import ...` gives) without running the package's `__init__`s: those
    import its text and vision datasets, hence transformers and sklearn (~6 s of CPU of a
    check's ~8.5 s). Only for the counting child: the package modules it registers are
    bare. Imported whole where streaming already is."""
    if "streaming" not in sys.modules:
        spec = importlib.util.find_spec("streaming")
        if spec is not None and spec.submodule_search_locations:
            for name, folders in (("streaming", list(spec.submodule_search_locations)),
                                  ("streaming.base", [f"{folder}/base" for folder
                                                      in spec.submodule_search_locations])):
                package = types.ModuleType(name)
                package.__path__ = folders
                sys.modules[name] = package
    stream = importlib.import_module("streaming.base.stream")
    dataset = importlib.import_module("streaming.base.dataset")
    return stream.Stream, dataset.StreamingDataset
