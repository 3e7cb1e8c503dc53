"""Replay progress on stderr: a worker replays its partitions from the beginning before it
decides anything, which after a long history takes a while, and an operator looking at a
silent process cannot tell a replay from a hang.

Only a long replay is reported (one still running after `after_s`), at most once every
`every_s`: partitions still replaying, events read of those to read, events/s and the
time left at that rate; then one line when every partition is live. A short replay (a
fresh log, a test) prints nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from turnstile.streams.partitions import ReplayProgress
from turnstile.streams.worker import Worker

POLL_S = 0.25  # how often the driver samples the worker; lines still come at most every `every_s`


def describe(progress: ReplayProgress, rate: float | None) -> str:
    left = progress.events_total - progress.events_done
    eta = f", about {_duration(left / rate)} left" if rate else ""
    speed = f", {rate:,.0f} events/s" if rate is not None else ""
    return (
        f"replaying {progress.replaying} of {progress.partitions} partitions: "
        f"{progress.events_done:,} of {progress.events_total:,} events{speed}{eta}"
    )


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes} min {secs} s" if minutes < 60 else f"{minutes // 60} h {minutes % 60} min"


@dataclass(slots=True)
class ReplayReporter:
    """Decides, from samples of the worker's progress and the time of each, what to say.
    The clock is the caller's (`observe(progress, now_s)`), so tests drive it."""

    write: Callable[[str], None]
    after_s: float = 2.0
    every_s: float = 1.0
    _started: tuple[float, int] | None = None  # when the replay began, and the events read by then
    _said_at: float | None = None

    def observe(self, progress: ReplayProgress, now_s: float) -> None:
        if progress.replaying == 0:
            if self._started is not None and self._said_at is not None:
                took = now_s - self._started[0]
                self.write(f"replayed {progress.events_done:,} events of {progress.partitions} partitions "
                           f"in {_duration(took)}; deciding")
            self._started = self._said_at = None
            return
        if self._started is None:
            self._started = (now_s, progress.events_done)
            return
        since, read_then = self._started
        if now_s - since < self.after_s or (self._said_at is not None and now_s - self._said_at < self.every_s):
            return
        rate = (progress.events_done - read_then) / (now_s - since)
        self.write(describe(progress, rate))
        self._said_at = now_s


async def report(worker: Worker, reporter: ReplayReporter, clock: Callable[[], float]) -> None:
    """Samples `worker` until cancelled (it runs beside the worker, as long as it does)."""
    while True:
        reporter.observe(worker.replay_progress(), clock())
        await asyncio.sleep(POLL_S)
