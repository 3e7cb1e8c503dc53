"""Waiting for the worker's fold to reach an offset: how the HTTP port learns what the log
made of a record it has just appended (a message id used twice: which use came first).

A fold observer: each event the worker folds settles the waits for its partition at or
below its offset. Everything here runs on the worker's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

from turnstile.events import Event
from turnstile.projections import ConversationState, Status
from turnstile.streams.log import Record

if TYPE_CHECKING:
    from turnstile.streams.worker import Worker


class FoldWatch:
    def __init__(self, worker: Worker) -> None:
        self._worker = worker
        self._waits: dict[int, list[tuple[int, asyncio.Future[None]]]] = {}
        worker.fold_observers.append(self)

    def detach(self) -> None:
        """No longer observe the worker's fold (its waits run out)."""
        with contextlib.suppress(ValueError):
            self._worker.fold_observers.remove(self)

    async def until_folded(self, partition: int, offset: int, timeout_s: float) -> bool:
        """Whether the worker has folded `partition` past `offset` within `timeout_s`."""
        if self._worker.folded_past(partition, offset):
            return True
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (offset, done)
        self._waits.setdefault(partition, []).append(entry)
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done, timeout_s)
            return done.done()
        finally:
            waits = self._waits.get(partition, [])
            if entry in waits:
                waits.remove(entry)

    # -- the worker's fold observer ------------------------------------------------------------
    def folded(self, record: Record, event: Event, state: ConversationState, ignored: str | None) -> None:
        waits = self._waits.get(record.partition)
        for offset, done in waits or ():
            if offset <= record.offset and not done.done():
                done.set_result(None)

    def restored(self, state: ConversationState) -> None:
        pass  # no event folded

    def evicted(self, conversation: str, status: Status) -> None:
        pass

    def stored(self, partition: int, conversations: list[tuple[str, Status]]) -> None:
        pass

    def forgotten(self, partition: int, conversations: set[str]) -> None:
        pass  # a partition handed over: its waits run out (the port then reads the log itself)
