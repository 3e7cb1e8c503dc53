"""Where the running service gets time and identifiers; the pure core takes them as arguments."""

from __future__ import annotations

import time
import uuid
from typing import Protocol


class Clock(Protocol):
    def now_ms(self) -> int: ...


class Ids(Protocol):
    def new(self) -> str: ...


class SystemClock:
    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000


class RandomIds:
    def new(self) -> str:
        return uuid.uuid4().hex
