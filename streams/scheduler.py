"""The scheduler task: publishes `InputInjected` for each due schedule occurrence.

It runs beside the worker, in its process. Correctness does not depend on it firing once:
the occurrence key (schedule id + occurrence time) is the input id, so a second firing
(another worker, a restart, a retried append) is a duplicate every reader ignores, and
the occurrence gets one logical turn. Beside a worker it fires only the schedules whose
conversation lives on a partition that worker owns and has replayed, and skips
occurrences the log already holds, so duplicates stay rare.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Protocol

from turnstile.events import InputInjected, encode
from turnstile.handlers.schedule import Schedule, due, injected, next_due, occurrence_key
from turnstile.projections import ConversationState
from turnstile.streams.eviction import NotLocal
from turnstile.streams.log import EventLog
from turnstile.streams.metrics import Metrics
from turnstile.streams.runtime import Clock, Ids, RandomIds, SystemClock

log = logging.getLogger(__name__)


class Owner(Protocol):
    """What the scheduler asks of the worker beside it (`streams.worker.Worker` is one)."""

    def live_here(self, conversation_id: str) -> bool: ...

    def state_of(self, conversation_id: str) -> ConversationState | None: ...


class Scheduler:
    def __init__(
        self,
        log_: EventLog,
        schedules: Sequence[Schedule],
        *,
        worker: Owner | None = None,
        clock: Clock | None = None,
        ids: Ids | None = None,
        max_sleep_s: float = 1.0,
        metrics: Metrics | None = None,
    ) -> None:
        self.log = log_
        self.schedules = tuple(schedules)
        self.worker = worker
        self.clock = clock or SystemClock()
        self.ids = ids or RandomIds()
        self.max_sleep_s = max_sleep_s
        self.metrics = metrics
        self.last_fired: dict[str, int] = {}

    def _ours(self, schedule: Schedule) -> bool:
        """Beside a worker: only for conversations on a partition it owns and has replayed."""
        return self.worker is None or self.worker.live_here(schedule.conversation_id)

    def _on_log(self, schedule: Schedule, key: str) -> bool | None:
        """Whether the occurrence is on the log already (None: not known yet)."""
        try:
            state = self.worker.state_of(schedule.conversation_id) if self.worker is not None else None
        except NotLocal:  # its state is being fetched to this worker
            return None
        return state is not None and key in state.seen_inputs

    async def tick(self) -> list[InputInjected]:
        """Publish every occurrence due now; returns what was published."""
        now = self.clock.now_ms()
        published: list[InputInjected] = []
        for schedule in self.schedules:
            if not self._ours(schedule):
                continue
            for at in due(schedule, self.last_fired.get(schedule.schedule_id), now):
                on_log = self._on_log(schedule, occurrence_key(schedule, at))
                if on_log is None:
                    break  # asked again at the next tick
                if not on_log:
                    event = injected(schedule, at, event_id=self.ids.new())
                    await self.log.append(self.log.topics.events, schedule.conversation_id, encode(event))
                    published.append(event)
                    log.info("schedule %s fired: %s", schedule.schedule_id, event.occurrence_key)
                    if self.metrics is not None:
                        self.metrics.scheduled.labels(schedule.schedule_id).inc()
                self.last_fired[schedule.schedule_id] = at
        return published

    def _sleep_s(self) -> float:
        now = self.clock.now_ms()
        upcoming = [t for s in self.schedules if (t := next_due(s, now)) is not None]
        if not upcoming:
            return self.max_sleep_s
        return max(0.01, min(self.max_sleep_s, (min(upcoming) - now) / 1000))

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.tick()
            except Exception:  # an append that failed: the occurrence is tried again next tick
                log.exception("a scheduler tick failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self._sleep_s())
