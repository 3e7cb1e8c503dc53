"""Storms of one log line, cut to a few a window.

While a broker is away, aiokafka logs the same few ERROR lines 1,500-5,000 times a second
per worker ("Unable connect to node ...", "Unable to update metadata ...": an outside
operator's worker wrote 240,000 lines, 28 MB, in 80 s). Each line says nothing the first
did not, and the flood fills disks and log pipelines. `RepeatLimit` lets the first few of
each line (its logger, level and message template, whatever its arguments) through per
window, counts the rest, and says how many it held back on the line that next passes.
It does not stop what logs them: aiokafka's reconnecting spins on, as it did.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

LIMITED_LOGGERS = "aiokafka"
KEYS_KEPT = 1_000  # distinct lines remembered; past it, those of ended windows are forgotten


@dataclass(slots=True)
class _Window:
    began: float
    passed: int = 0
    held: int = 0


class RepeatLimit(logging.Filter):
    def __init__(self, per_window: int = 5, window_s: float = 10.0, now: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.per_window, self.window_s, self._now = per_window, window_s, now
        self._windows: dict[tuple[str, int, str], _Window] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, str(record.msg))
        now = self._now()
        window = self._windows.get(key)
        if window is None or now - window.began >= self.window_s:
            held = window.held if window is not None else 0
            if window is None and len(self._windows) >= KEYS_KEPT:
                self._forget_ended(now)
            window = self._windows[key] = _Window(now)
            if held:  # said on the line that passes next, formatted now (no args left to apply)
                note = f"[{held} more like this in the {self.window_s:g} s before, not shown]"
                record.msg = f"{record.getMessage()} {note}"
                record.args = None
        if window.passed < self.per_window:
            window.passed += 1
            return True
        window.held += 1
        return False

    def _forget_ended(self, now: float) -> None:
        for key in [k for k, w in self._windows.items() if now - w.began >= self.window_s]:
            del self._windows[key]


_LIMIT = RepeatLimit()


def limit_client_storms() -> None:
    """Puts the one `RepeatLimit` on every logger of aiokafka (a logger's filters see only the
    lines it makes itself, not its children's, so each gets it). Idempotent."""
    import aiokafka  # noqa: F401  (its modules make their loggers when imported)

    for name, logger in list(logging.root.manager.loggerDict.items()):
        ours = name == LIMITED_LOGGERS or name.startswith(f"{LIMITED_LOGGERS}.")
        if ours and isinstance(logger, logging.Logger) and _LIMIT not in logger.filters:
            logger.addFilter(_LIMIT)
