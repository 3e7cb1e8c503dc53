"""Storms of one log line, cut to a few a window.

While a broker is away, aiokafka logs the same few ERROR lines 1,500-5,000 times a second
per worker ("Unable connect to node ...", "Unable to update metadata ...": an outside
operator's worker wrote 240,000 lines, 28 MB, in 80 s). Each line says nothing the first
did not, and the flood fills disks and log pipelines. `RepeatLimit` lets the first few of
each line (its logger, level and message template, whatever its arguments) through per
window, counts the rest, and says how many it held back on the line that next passes.
It does not stop what logs them: aiokafka's reconnecting spins on, as it did.

A filter runs inside the caller's logging call: it never raises (a line it cannot read
passes as it is), and it holds a lock, since one process may log from several threads.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

LIMITED_LOGGERS = "aiokafka"
KEYS_KEPT = 1_000  # distinct lines tracked; past it (after forgetting ended windows), new ones pass untracked


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
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            with self._lock:
                return self._passes(record)
        except Exception:  # never into the caller's logging call
            return True

    def _passes(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, str(record.msg))
        now = self._now()
        window = self._windows.get(key)
        if window is None or now - window.began >= self.window_s:
            if window is None and len(self._windows) >= KEYS_KEPT:
                self._forget_ended(now)
                if len(self._windows) >= KEYS_KEPT:
                    return True  # that many distinct lines at once are no storm of one line
            if window is not None and window.held:  # said on the next line, formatted now (no args left)
                note = f"[{window.held} more like this in the {now - window.began:.0f} s before, not shown]"
                record.msg = f"{record.getMessage()} {note}"
                record.args = None
            window = self._windows[key] = _Window(now)
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
    import aiokafka.admin  # noqa: F401  (aiokafka's modules and its admin's make their loggers when imported)

    for name, logger in list(logging.root.manager.loggerDict.items()):
        ours = name == LIMITED_LOGGERS or name.startswith(f"{LIMITED_LOGGERS}.")
        if ours and isinstance(logger, logging.Logger) and _LIMIT not in logger.filters:
            logger.addFilter(_LIMIT)
