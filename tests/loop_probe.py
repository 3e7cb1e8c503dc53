"""How long the event loop was held: a callback that reschedules itself runs once per loop
iteration, so the gap between two of its runs is what the rest of the loop held it for.
Used by the HTTP probe test and by the benchmark of a replay's loop holds (bench section 11)."""

from __future__ import annotations

import asyncio


class LoopProbe:
    def __init__(self) -> None:
        self.gaps_s: list[float] = []
        self._last = 0.0
        self._handle: asyncio.Handle | None = None

    @property
    def longest_s(self) -> float:
        return max(self.gaps_s, default=0.0)

    def start(self) -> None:
        self._last = asyncio.get_running_loop().time()
        self._tick()

    def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        self.gaps_s.append(now - self._last)
        self._last = now
        self._handle = loop.call_soon(self._tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
