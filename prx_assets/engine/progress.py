"""Progress a person can read: one line per stage, instead of Ray Data's operator dumps.

Ray Data, writing to a non-interactive terminal (a Dagster run, `make demo`), logs its whole
operator topology every ten seconds: a dozen lines per dump, hundreds per run, none of which
says how far the stage is. A stage here knows what it is doing (rows pending, rows done), so
it reports that itself, one line at a time:

    bucketed_images[demo_wds]: 1,200 / 2,000 rows (60%), 45.1 rows/s, ETA 18 s

Dagster's event log stays the record: the line goes to the run's logger.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

# Ray Data's one-time notice when its bars are off is about the bars we turned off on purpose.
_NOTICES_DROPPED = ("Progress bars disabled",)


class _DropNotices(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(record.getMessage().startswith(n) for n in _NOTICES_DROPPED)


def quiet_ray_data() -> None:
    """Turn off Ray Data's progress bars and periodic topology dumps in this process (the
    driver: it is the one that prints them); warnings and errors still come through."""
    import ray.data

    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    context.enable_operator_progress_bars = False
    context.print_on_execution_start = False
    for name in ("ray.data", "ray.data._internal.progress"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNotices) for f in logger.filters):
            logger.addFilter(_DropNotices())
    # "Dataset ... execution finished in N seconds" at INFO: the stage's own line says so.
    logging.getLogger("ray.data._internal.execution.streaming_executor").setLevel(
        logging.WARNING)
    # "Data sink LanceOverwrite finished. N rows ..." at INFO: the commit's line says so.
    logging.getLogger("ray.data.dataset").setLevel(logging.WARNING)
    # "<dataset> registers for logging while another dataset ... is also logging" at INFO:
    # two datasets at once are expected (Ray Data's background start beside a first stage).
    logging.getLogger("ray.data._internal.logging").setLevel(logging.WARNING)


def _duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


class StageProgress:
    """Rows done out of a known (or unknown) total, reported at most once per `every_s`
    seconds (the first line `every_s` after the start, so a short stage logs only its
    closing line) and always at the end. `clock` is injectable so tests never wait on time.

    A total is what the stage can count cheaply before it starts (a Lance `count_rows`); when
    that is an estimate and the stage goes past it, the line drops it (no "120%", no false
    ETA) and counts on without one."""

    def __init__(self, stage: str, total: int | None, log: Callable[[str], None],
                 every_s: float = 10.0, unit: str = "rows",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stage, self.total, self.unit = stage, total, unit
        self.done = 0
        self._log, self._every, self._clock = log, every_s, clock
        self._started = clock()
        self._last_report = self._started

    @property
    def elapsed(self) -> float:
        return self._clock() - self._started

    @property
    def rate(self) -> float:
        elapsed = self.elapsed
        return self.done / elapsed if elapsed > 0 else 0.0

    def line(self) -> str:
        """The current state in one line (what `advance` and `finish` log)."""
        rate = self.rate
        if self.total:
            share = f" ({min(1.0, self.done / self.total):.0%})"
            left = max(0, self.total - self.done)
            eta = f", ETA {_duration(left / rate)}" if rate > 0 and left else ""
            counted = f"{self.done:,} / {self.total:,} {self.unit}{share}"
        else:
            eta, counted = "", f"{self.done:,} {self.unit}"
        return f"{self.stage}: {counted}, {rate:,.1f} {self.unit}/s{eta}"

    def advance(self, rows: int) -> None:
        """Count `rows` more; log a line if the last one (or the start) is `every_s` old."""
        self.update(self.done + rows)

    def update(self, done: int, total: int | None = None) -> None:
        """Set the count to `done` (callbacks that see a running total), and the total when
        the stage only learns it once running; log as `advance` does."""
        self.done = done
        if total is not None:
            self.total = total
        if self.total is not None and self.done > self.total:
            self.total = None  # an estimate the stage went past
        now = self._clock()
        # At the total, the closing line follows at once: no line just before it.
        at_end = self.total is not None and self.done >= self.total
        if now - self._last_report >= self._every and not at_end:
            self._last_report = now
            self._log(self.line())

    def finish(self) -> None:
        """The closing line, with the total time."""
        if self.done == 0 and self.total == 0:
            self._log(f"{self.stage}: nothing to do, up to date; done in "
                      f"{_duration(self.elapsed)}")
            return
        self._log(f"{self.line().split(', ETA')[0]}; done in {_duration(self.elapsed)}")

