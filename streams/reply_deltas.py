"""The worker's side of streamed replies: the text of a reply in progress, sent to the
deltas topic as it arrives, without ever holding the reply up.

One background sender keeps the records of the process in order (per conversation, as the
topic is keyed by it); sends are not waited for. If the log falls behind by `max_pending`
records, new deltas are dropped (and counted in the log): readers then see a gap, the
events topic still records the whole reply.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Protocol

from pydantic import ValidationError

from turnstile.events.deltas import MAX_DELTA_CHARS, ReplyDelta, encode_delta
from turnstile.handlers.provider import ReplyStream
from turnstile.streams.log import Acknowledged, EventLog

log = logging.getLogger(__name__)


class IterationStream(ReplyStream, Protocol):
    async def finish(self) -> None:
        """The iteration's reply is complete."""
        ...


class ReplyStreams(Protocol):
    """Opens the stream of one iteration's reply."""

    def open(
        self, conversation_id: str, turn_id: str, run_id: str, attempt: int, iteration: int
    ) -> IterationStream: ...


class DeltaPublisher:
    def __init__(self, log_: EventLog, topic: str, now_ms: Callable[[], int], max_pending: int = 10_000) -> None:
        self._log = log_
        self._topic = topic
        self._now_ms = now_ms
        self._queue: asyncio.Queue[ReplyDelta] = asyncio.Queue(max_pending)
        self._sender: asyncio.Task[None] | None = None
        self.dropped = 0

    def open(self, conversation_id: str, turn_id: str, run_id: str, attempt: int, iteration: int) -> IterationStream:
        return _Iteration(self, conversation_id, turn_id, run_id, attempt, iteration)

    def publish(self, delta: ReplyDelta) -> None:
        if self._sender is None:
            self._sender = asyncio.create_task(self._send_all(), name="reply-deltas")
        try:
            self._queue.put_nowait(delta)
        except asyncio.QueueFull:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning("reply deltas: the log is behind, %d dropped so far", self.dropped)

    @property
    def now_ms(self) -> int:
        return self._now_ms()

    async def aclose(self, timeout_s: float = 2.0) -> None:
        """Hands what is queued to the log (within `timeout_s`), then stops the sender."""
        if self._sender is None:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._queue.join()
        self._sender.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._sender
        self._sender = None

    async def _send_all(self) -> None:
        while True:
            delta = await self._queue.get()
            try:
                landed = await self._log.send(self._topic, delta.conversation_id, encode_delta(delta))
                landed.add_done_callback(_note_failure)
            except Exception as exc:  # a delta is never worth failing a turn for
                log.warning("reply delta not sent: %s: %s", type(exc).__name__, exc)
            finally:
                self._queue.task_done()


def _note_failure(landed: asyncio.Future[Acknowledged]) -> None:
    if not landed.cancelled() and landed.exception() is not None:
        log.warning("reply delta not written: %s", landed.exception())


class _Iteration:
    def __init__(
        self, publisher: DeltaPublisher, conversation_id: str, turn_id: str, run_id: str, attempt: int, iteration: int
    ) -> None:
        self._publisher = publisher
        self._seq = 0
        self._ids = {
            "conversation_id": conversation_id,
            "turn_id": turn_id,
            "run_id": run_id,
            "attempt": attempt,
            "iteration": iteration,
        }

    def _publish(self, text: str = "", restart: bool = False, done: bool = False) -> None:
        fields = {**self._ids, "seq": self._seq, "occurred_at": self._publisher.now_ms}
        try:
            delta = ReplyDelta.model_validate({**fields, "text": text, "restart": restart, "done": done})
        except ValidationError as exc:  # its number is used all the same: readers see the gap
            log.warning("reply delta %d dropped: %s", self._seq, exc.errors()[0]["msg"])
            return
        finally:
            self._seq += 1
        self._publisher.publish(delta)

    async def delta(self, text: str) -> None:
        # A provider's piece may be longer than a delta holds (a server that sends its
        # answer in one chunk): it goes as several, so a reader joining them loses nothing.
        for start in range(0, max(len(text), 1), MAX_DELTA_CHARS):
            self._publish(text[start : start + MAX_DELTA_CHARS])

    async def restart(self) -> None:
        self._publish(restart=True)

    async def finish(self) -> None:
        self._publish(done=True)
