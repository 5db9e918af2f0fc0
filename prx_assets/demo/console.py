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
import sys
import textwrap
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
    - Not silenced: Ray's C++ core logs a notice about actor restarts ("constructor
      arguments in the object store") at its ERROR level; RAY_BACKEND_LOG_LEVEL would hide
      it but makes every raylet print a longer line saying so.
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
