"""The stage progress line: readable, throttled by an injected clock (no real waiting)."""

import logging

from prx_assets.engine.progress import StageProgress, quiet_ray_data


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_line_counts_rate_and_eta():
    clock, lines = FakeClock(), []
    progress = StageProgress("bucketed_images[demo]", 2000, lines.append, clock=clock)
    clock.now += 20
    progress.advance(1200)
    assert lines == ["bucketed_images[demo]: 1,200 / 2,000 rows (60%), 60.0 rows/s, ETA 13 s"]


def test_reports_at_most_once_per_interval_and_always_at_the_end():
    clock, lines = FakeClock(), []
    progress = StageProgress("captions[x]", 100, lines.append, every_s=10, clock=clock)
    for _ in range(9):  # nine chunks in 9 s: nothing yet (a short stage logs one line)
        clock.now += 1
        progress.advance(5)
    assert lines == []
    clock.now += 1
    progress.advance(5)  # 10 s after the start
    assert len(lines) == 1 and "50 / 100" in lines[-1]
    clock.now += 9
    progress.advance(5)  # 9 s after the first report: waits
    assert len(lines) == 1
    clock.now += 1
    progress.advance(5)
    assert len(lines) == 2 and "60 / 100" in lines[-1]
    progress.finish()
    assert lines[-1].endswith("done in 20 s") and "ETA" not in lines[-1]


def test_update_sets_running_counts_and_a_late_total():
    clock, lines = FakeClock(), []
    progress = StageProgress("caption_labels[x]", None, lines.append, clock=clock)
    clock.now += 10
    progress.update(40, total=200)  # the stage learnt its total once running
    assert lines == ["caption_labels[x]: 40 / 200 rows (20%), 4.0 rows/s, ETA 40 s"]
    clock.now += 10
    progress.update(250)  # an estimated total the stage went past: counted without it
    assert progress.total is None and lines[-1] == "caption_labels[x]: 250 rows, 12.5 rows/s"


def test_no_periodic_line_at_the_total_just_before_the_closing_one():
    clock, lines = FakeClock(), []
    progress = StageProgress("mds_shards[x]", 100, lines.append, clock=clock)
    clock.now += 30
    progress.update(100)
    assert lines == []
    progress.finish()
    assert lines == ["mds_shards[x]: 100 / 100 rows (100%), 3.3 rows/s; done in 30 s"]


def test_nothing_to_do_says_so():
    clock, lines = FakeClock(), []
    progress = StageProgress("bucketed_images[x]", 0, lines.append, clock=clock)
    clock.now += 2
    progress.finish()
    assert lines == ["bucketed_images[x]: nothing to do, up to date; done in 2 s"]


def test_unknown_total_and_long_durations():
    clock, lines = FakeClock(), []
    progress = StageProgress("raw_images[big]", None, lines.append, unit="files", clock=clock)
    clock.now += 7325
    progress.advance(7325)
    progress.finish()
    assert lines[0] == "raw_images[big]: 7,325 files, 1.0 files/s"
    assert lines[-1].endswith("done in 2 h 02 min")


def test_eta_in_minutes():
    clock, lines = FakeClock(), []
    progress = StageProgress("s", 1000, lines.append, clock=clock)
    clock.now += 10
    progress.advance(100)  # 10 rows/s, 900 left
    assert lines[0].endswith("ETA 1 min 30 s")


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_quiet_ray_data_turns_bars_off_and_drops_the_notice():
    import ray.data

    quiet_ray_data()
    quiet_ray_data()  # idempotent: one filter, not two
    context = ray.data.DataContext.get_current()
    assert not context.enable_progress_bars and not context.enable_operator_progress_bars
    logger = logging.getLogger("ray.data._internal.progress")
    assert len(logger.filters) == 1
    collect = Collect()
    logger.addHandler(collect)  # Ray's loggers do not propagate to the root logger
    try:
        logger.warning("Progress bars disabled. To enable, set ...")
        logger.warning("something else")
    finally:
        logger.removeHandler(collect)
    assert collect.messages == ["something else"]
    # Sink notices ("Data sink LanceOverwrite finished ...") stay off the console.
    assert logging.getLogger("ray.data.dataset").level == logging.WARNING
