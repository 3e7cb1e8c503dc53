"""One running turn as the worker holds it: its task, its appends, how the fold judged them
when the consumer read them back, the side-effect gate, and suspension at step boundaries.

The runner appends through `RunnerSlot.append`. Every append that waits for its
acknowledgement is a step boundary (the step before it is on the log, the next has not
begun) except an outcome, after which the turn is over, and a side-effecting
`ToolCallStarted`, which begins its call: the body follows its read-back at once. A revoke
`suspend`s the slot: the step in progress finishes -- a model reply recorded, a tool call
and its `ToolCallFinished` -- and the runner then waits at the boundary until the worker
knows whether the partition stayed (`resume`) or moved (the task is cancelled there, with
nothing in flight).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from turnstile.events import OUTCOME_TYPES, Event, MessageReceived, encode
from turnstile.handlers.turn_rules import fenced
from turnstile.streams.log import Acknowledged

log = logging.getLogger(__name__)

# Puts one encoded event of this slot's conversation in the log's order (see `EventLog.send`).
Send = Callable[[bytes], Awaitable["asyncio.Future[Acknowledged]"]]


class Superseded(BaseException):
    """The run's side-effecting `ToolCallStarted` was refused when read back: another owner
    took the turn over first, so every reader ignores this run and the tool must not run.

    A BaseException, like a cancellation, so that it passes through the runner's catch-all
    for internal errors (which would write a failure): a superseded run writes nothing more.
    The slot's `run` ends the task quietly on it."""


class RunnerSlot:
    def __init__(self, conversation_id: str, partition: int, send: Send) -> None:
        self.conversation_id = conversation_id
        self.partition = partition
        self._send = send
        self.task: asyncio.Task[None] | None = None
        self.last_offset = -1  # offset of the last event this runner appended
        self.run_id: str | None = None  # the run of its last append
        # event id -> how the fold judged it when the consumer read it back (True: accepted).
        self._verdicts: dict[str, asyncio.Future[bool]] = {}
        # value -> the event it encodes, for each append not read back yet: the consumer
        # reading its own bytes back need not parse and validate them again.
        self._written: dict[bytes, Event] = {}
        self._unacked: list[asyncio.Future[Acknowledged]] = []
        self._go = asyncio.Event()
        self._go.set()
        self._resting = False  # waiting at a step boundary, suspended
        self._rested = asyncio.Event()
        # The read-back a side-effecting call waits for before its body runs.
        self._read_back: asyncio.Future[bool] | None = None
        # Asks the turn to withdraw for a new message (interrupt-and-merge); False: it runs on.
        self.interrupt: Callable[[MessageReceived], bool] = _runs_on

    def start(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        self.task = asyncio.create_task(self._run(work), name=f"turn:{self.conversation_id}")
        return self.task

    async def _run(self, work: Coroutine[Any, Any, None]) -> None:
        try:
            await work
        except Superseded as stop:
            log.warning("%s: %s; its tool did not run", self.conversation_id, stop)

    # -- the runner's side ---------------------------------------------------------------
    async def append(self, event: Event, wait: bool = True, value: bytes | None = None) -> None:
        """`value`: the event's encoding, when the caller has made it. `wait=False` returns
        once the event is in the log's order; the next append that waits also waits for its
        acknowledgement (one round trip for both). A fenced event always waits: its tool must
        not run before the read-back, whatever the caller asked."""
        verdict = self._verdicts[event.event_id] = asyncio.get_running_loop().create_future()
        if value is None:
            value = encode(event)
        self._written[value] = event
        self._unacked.append(await self._send(value))
        self.run_id = getattr(event, "run_id", self.run_id)
        if not wait and not fenced(event):
            return
        acks, self._unacked = self._unacked, []
        for ack in acks:
            self.last_offset = max(self.last_offset, (await ack).offset)
        if isinstance(event, OUTCOME_TYPES):
            return  # the turn is over: no next step to hold back
        if fenced(event):
            # Fencing a side effect (`handlers.turn_rules.fenced`): the tool runs only once its
            # ToolCallStarted is read back as accepted. Written after another owner's takeover,
            # it is ignored by every reader -- and the tool must not run either. The call is the
            # step in progress from here: its body follows the read-back with nothing between.
            self._read_back = verdict
            try:
                if not await verdict:
                    raise Superseded(f"run {self.run_id} was superseded before its side effect")
            finally:
                self._read_back = None
            return
        if self._go.is_set():
            return  # a boundary, not suspended: on at once
        self._resting = True
        self._rested.set()
        try:
            await self._go.wait()
        finally:
            self._resting = False

    # -- the worker's side ---------------------------------------------------------------
    def written_as(self, value: bytes) -> Event | None:
        """The event this runner appended as exactly `value` (once: it is being read back),
        or None. Equal bytes decode to an equal event, so the fold may take this one."""
        return self._written.pop(value, None)

    def judged(self, event_id: str, accepted: bool) -> bool:
        """The consumer read back this runner's event; False if it was not this runner's.
        A refused event means another owner took the turn over (or won the claim) first:
        every reader ignores this run from here on, so the runner stops instead of calling
        the model or tools for nothing."""
        verdict = self._verdicts.pop(event_id, None)
        if verdict is None:
            return False
        gate = verdict is self._read_back  # the gate raises Superseded on it by itself
        if not verdict.done():
            verdict.set_result(accepted)
        if not accepted and not gate and self.task is not None and not self.task.done():
            log.warning("an event of %s was refused on the log: its run was superseded", self.conversation_id)
            self.task.cancel()
        return True

    def released(self, position: int) -> bool:
        """Done, and everything it wrote has been folded (`position`: the partition's)."""
        return self.task is not None and self.task.done() and position > self.last_offset

    @property
    def suspended(self) -> bool:
        return not self._go.is_set()

    def suspend(self) -> None:
        """Hold the runner at its next step boundary (the step in progress finishes)."""
        self._go.clear()
        self._rested.clear()

    def resume(self) -> None:
        self._go.set()

    @property
    def awaiting_read_back(self) -> bool:
        """A side-effecting call is on the log and waits for its read-back to run."""
        return self._read_back is not None and not self._read_back.done()

    @property
    def at_rest(self) -> bool:
        """Nothing in progress: ended, or waiting at a boundary."""
        return self.task is None or self.task.done() or self._resting

    async def until_at_rest(self) -> None:
        """Once suspended: until the step in progress has finished (or the turn ended)."""
        if self.at_rest or self.task is None:
            return
        rested = asyncio.ensure_future(self._rested.wait())
        try:
            await asyncio.wait([rested, self.task], return_when=asyncio.FIRST_COMPLETED)
        finally:
            rested.cancel()


def _runs_on(_message: MessageReceived) -> bool:
    return False  # until the worker hands the slot its runner's interrupt
