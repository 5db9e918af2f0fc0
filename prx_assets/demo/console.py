"""The demo's console: one short line per Dagster event, third-party noise said once.

Dagster's own console logger prefixes every line with the job name and the full run id
(~110 characters before the message) and prints whole tracebacks and metadata dicts; the
demo prints `HH:MM:SS run8 [source] step: EVENT message`, each line at most MAX_WIDTH
characters. The run's event log in the instance keeps every event, in full, whatever the
console shows (`make ui`).
"""

from __future__ import annotations

import logging
import os
import re
import sys
import textwrap
import threading
import warnings
from collections.abc import Mapping
from datetime import datetime

import dagster as dg

MAX_WIDTH = 160
RUN_ID_CHARS = 8
# An error's text (a failure's traceback) is shown up to this many lines, each clipped.
ERROR_LINES = 12
PARTITION_TAG = "dagster/partition"


def clip(line: str, width: int = MAX_WIDTH) -> str:
    """`line` cut to `width` characters, with an ellipsis when cut."""
    return line if len(line) <= width else line[:width - 1] + "…"


def wrap(line: str, width: int = MAX_WIDTH) -> list[str]:
    """`line` as lines of at most `width` characters, the continuations indented under it
    (for summary lines whose words all matter, where `clip` would lose some)."""
    if len(line) <= width:
        return [line]
    indent = " " * (len(line) - len(line.lstrip()) + 3)
    return textwrap.wrap(line, width, subsequent_indent=indent, break_on_hyphens=False)


def short_event(metadata: Mapping, level: str, when: datetime) -> list[str]:
    """The console lines of one Dagster log record's metadata (DagsterLogRecordMetadata):
    the first says when, which run (8 characters), which source, which step, what event;
    an error's text follows, indented and clipped."""
    event = metadata.get("dagster_event")
    kind = _event_name(event)
    partition = (metadata.get("job_tags") or {}).get(PARTITION_TAG)
    where = metadata.get("step_key") or (f"resource:{metadata['resource_name']}"
                                         if metadata.get("resource_name") else "")
    message = " ".join(str(metadata.get("orig_message") or "").split("\n")[:1]).strip()
    parts = [when.strftime("%H:%M:%S"), level[:1],
             str(metadata.get("run_id") or "")[:RUN_ID_CHARS],
             f"[{partition}]" if partition else "", f"{where}:" if where else "",
             kind, message if message != kind else ""]
    lines = [clip(" ".join(p for p in parts if p))]
    error = _error_text(event)
    if error:
        lines += [clip("    " + line) for line in error.splitlines()[-ERROR_LINES:] if line]
    return lines


def _event_name(event: dg.DagsterEvent | None) -> str:
    if event is None:
        return ""
    from dagster._core.events import EVENT_TYPE_TO_DISPLAY_STRING

    kind = event.event_type
    return EVENT_TYPE_TO_DISPLAY_STRING.get(kind, kind.value)


def _error_text(event: object) -> str:
    error = getattr(getattr(event, "event_specific_data", None), "error", None)
    return error.to_string() if error is not None else ""


class ShortFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        from dagster._core.log_manager import LOG_RECORD_METADATA_ATTR

        metadata = getattr(record, LOG_RECORD_METADATA_ATTR, None)
        when = datetime.fromtimestamp(record.created)
        if metadata is None:  # a plain Python log record
            return clip(f"{when:%H:%M:%S} {record.levelname[:1]} {record.getMessage()}")
        return "\n".join(short_event(metadata, record.levelname, when))


@dg.logger(config_schema={"log_level": dg.Field(str, is_required=False, default_value="INFO")},
           description="One short line per event (the demo's console).")
def short_console_logger(init_context: dg.InitLoggerContext) -> logging.Logger:
    logger = logging.Logger("prx_demo", level=init_context.logger_config["log_level"].upper())
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(ShortFormatter())
    logger.addHandler(handler)
    return logger


def quiet_third_party() -> list[str]:
    """Silence what the demo cannot act on, before Lance or Ray start; returns the notes to
    print once instead.

    - Lance logs "No existing dataset at ..." (as a warning) each time a table is created:
      its log level is set to errors only.
    - Lance warns that it is not fork-safe whenever the process forks (Ray starting its
      workers); the demo's processes never use a Lance dataset across a fork.
    - Ray's C++ core logs a notice about actor restarts ("constructor arguments in the
      object store", ray#53727) at its ERROR level for every Ray Data actor pool: Ray Data
      itself puts those arguments there. `NoticeFilter` drops the line on the process's
      stderr and says it once (RAY_BACKEND_LOG_LEVEL would hide real errors too).
    - Ray warns that token authentication is off for a local cluster: the demo's cluster
      listens on loopback only, so auth is set off explicitly, and said once. A cluster
      named by RAY_ADDRESS keeps its own settings.
    """
    notes = []
    os.environ.setdefault("LANCE_LOG", "error")
    warnings.filterwarnings("ignore", message="lance is not fork-safe")
    if not os.environ.get("RAY_ADDRESS") and "RAY_AUTH_MODE" not in os.environ:
        os.environ["RAY_AUTH_MODE"] = "disabled"
        notes.append("ray: a local cluster on 127.0.0.1 only, token authentication off "
                     "(RAY_AUTH_MODE=token turns it on)")
    return notes


# Lines written straight to the process's stderr by native code (no Python logger to
# configure), each with the note said once in its place.
NATIVE_NOTICES = (
    (re.compile(rb"core_worker\.cc:\d+: Actor with class name: .* has constructor arguments "
                rb"in the object store and max_restarts > 0"),
     "ray: actor pools log an ERROR-level notice about restarting actors (ray#53727); "
     "it is about Ray Data's own arguments, shown once here"),
    # The raylet repeats this every 10 s while its disk is past a share of its capacity
    # (local_fs_capacity_threshold, 0.95): on a big, shared disk that is still many GB free.
    (re.compile(rb"file_system_monitor\.cc:\d+: (?P<path>\S+) is over (?P<share>\d+)% full, "
                rb"available space: (?P<free>[\d.]+) GB; capacity: (?P<capacity>[\d.]+) GB"),
     "ray: the disk of {path} is over {share}% full ({free} GB free of {capacity}); "
     "objects Ray must spill will fail. Said once"),
)


class NoticeFilter:
    """Routes file descriptor 2 through a pipe and a thread that drops the lines of
    NATIVE_NOTICES, printing each one's note once; every other line passes unchanged.

    The thread keeps forwarding after `close` (Ray's processes inherit the pipe and may
    still write to it), so nothing written to stderr is lost or blocked."""

    def __init__(self, notices=NATIVE_NOTICES) -> None:
        self.notices = notices
        self.said: set[str] = set()
        self._saved: int | None = None
        self._drained = threading.Event()
        self._marker = b"prx-notice-filter-drained-%d\n" % id(self)

    def __enter__(self) -> NoticeFilter:
        sys.stderr.flush()
        self._saved = os.dup(2)
        read_end, write_end = os.pipe()
        os.dup2(write_end, 2)
        os.close(write_end)
        threading.Thread(target=self._forward, args=(read_end, self._saved), daemon=True,
                         name="prx-notice-filter").start()
        return self

    def __exit__(self, *exc: object) -> None:
        sys.stderr.flush()
        if self._saved is None:
            return
        # Everything this process wrote before is through once the marker is: a barrier,
        # not a wait for quiet. The bound only guards against a forwarder that died.
        os.write(2, self._marker)
        self._drained.wait(timeout=30)
        os.dup2(self._saved, 2)  # our own pipe end closes; inherited ones live on

    def filtered(self, line: bytes) -> bytes:
        """What to write for one line: the line, its note the first time (with what the
        pattern's named groups caught), or nothing."""
        for pattern, note in self.notices:
            match = pattern.search(line)
            if match:
                if note in self.said:
                    return b""
                self.said.add(note)
                caught = {k: v.decode(errors="replace") for k, v in match.groupdict().items()}
                return clip(note.format(**caught)).encode() + b"\n"
        return line

    def _forward(self, read_end: int, out: int) -> None:
        with os.fdopen(read_end, "rb", buffering=0) as pipe:
            for line in iter(pipe.readline, b""):
                if line == self._marker:
                    self._drained.set()
                    continue
                data = self.filtered(line)
                if data:
                    os.write(out, data)
