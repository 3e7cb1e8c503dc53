"""The reader's side of streamed replies: what `GET /conversations/{id}/stream` serves.

The hub follows two topics: the deltas topic (the text of replies in progress) and the
events topic (attempts that failed, outcomes). For every conversation with a reply in
progress it keeps the text so far, so that a reader who joins mid-reply gets it first;
then it hands each subscriber, in order:

    delta        {turn_id, run_id, attempt, iteration, text}   text that follows
    restart      {turn_id, run_id, attempt, iteration}         the iteration's text so far is void
    interrupted  {turn_id, run_id, attempt, reason, retryable} the attempt failed (its worker died, ...),
                 or a new message withdrew the turn (`TurnInterrupted`: a turn answering both follows)
    outcome      the terminal outcome event, as on the events topic: the stream ends

The two topics are read independently, so an outcome may arrive before the last deltas of
its reply, or before any: the hub holds it until that reply is marked done (or `hold_s`
passed; an outcome with no delta of its run seen is held only while someone reads). Deltas
of runs that already ended are ignored. Nothing here is durable: the events topic is the record.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from turnstile.events import OUTCOME_TYPES, AttemptFailed, DecodeError, Event, TurnInterrupted, decode_record
from turnstile.events.deltas import ReplyDelta, decode_delta
from turnstile.streams.log import Record

log = logging.getLogger(__name__)

StreamKind = Literal["delta", "restart", "interrupted", "outcome"]
Follow = Callable[[], AsyncIterator[Record]]
# Run ids whose late deltas are ignored; a bound, not a time.
ENDED_RUNS_KEPT = 10_000


@dataclass(frozen=True, slots=True)
class StreamEvent:
    kind: StreamKind
    data: dict[str, Any]

    def sse(self) -> bytes:
        return b"event: " + self.kind.encode() + b"\ndata: " + orjson.dumps(self.data) + b"\n\n"


@dataclass(slots=True)
class _Reply:
    """The reply in progress of one conversation: one run, its iterations' text so far."""

    turn_id: str
    run_id: str
    attempt: int
    texts: dict[int, str] = field(default_factory=dict)
    open_iterations: set[int] = field(default_factory=set)


@dataclass(slots=True)
class _Conversation:
    reply: _Reply | None = None
    subscribers: list[asyncio.Queue[StreamEvent]] = field(default_factory=list)
    held_outcome: StreamEvent | None = None
    release: asyncio.TimerHandle | None = None


class ReplyHub:
    def __init__(self, hold_s: float = 1.0) -> None:
        self._hold_s = hold_s
        self._conversations: dict[str, _Conversation] = {}
        self._ended: OrderedDict[str, None] = OrderedDict()

    # -- subscribers ---------------------------------------------------------------------------

    def subscribe(self, conversation_id: str) -> asyncio.Queue[StreamEvent]:
        """A queue that starts with the text so far of the reply in progress, if any."""
        queue: asyncio.Queue[StreamEvent] = asyncio.Queue()
        conversation = self._conversations.setdefault(conversation_id, _Conversation())
        reply = conversation.reply
        if reply is not None:
            for iteration, text in sorted(reply.texts.items()):
                queue.put_nowait(StreamEvent("delta", {**_ids(reply), "iteration": iteration, "text": text}))
        conversation.subscribers.append(queue)
        return queue

    def unsubscribe(self, conversation_id: str, queue: asyncio.Queue[StreamEvent]) -> None:
        conversation = self._conversations.get(conversation_id)
        if conversation is None:
            return
        if queue in conversation.subscribers:
            conversation.subscribers.remove(queue)
        self._forget_if_idle(conversation_id)

    # -- what the topics say ------------------------------------------------------------------------

    def on_delta(self, delta: ReplyDelta) -> None:
        if delta.run_id in self._ended:
            return  # late: its attempt already failed or its turn ended
        conversation = self._conversations.setdefault(delta.conversation_id, _Conversation())
        reply = conversation.reply
        if reply is None or reply.run_id != delta.run_id:
            reply = conversation.reply = _Reply(delta.turn_id, delta.run_id, delta.attempt)
        ids = {**_ids(reply), "iteration": delta.iteration}
        if delta.restart:
            reply.texts.pop(delta.iteration, None)
            reply.open_iterations.discard(delta.iteration)
            self._tell(conversation, StreamEvent("restart", ids))
        elif delta.done:
            reply.open_iterations.discard(delta.iteration)
            if conversation.held_outcome is not None and not reply.open_iterations:
                self._release(delta.conversation_id)
        elif delta.text:
            reply.texts[delta.iteration] = reply.texts.get(delta.iteration, "") + delta.text
            reply.open_iterations.add(delta.iteration)
            self._tell(conversation, StreamEvent("delta", {**ids, "text": delta.text}))

    def on_event(self, event: Event) -> None:
        if isinstance(event, AttemptFailed | TurnInterrupted):
            self._end_run(event.run_id)
            conversation = self._conversations.get(event.conversation_id)
            if conversation is None:
                return
            if conversation.reply is not None and conversation.reply.run_id == event.run_id:
                conversation.reply = None
            data = {"turn_id": event.turn_id, "run_id": event.run_id, "attempt": event.attempt}
            if isinstance(event, TurnInterrupted):
                why = f"message {event.message_id} arrived: one turn answers it with the earlier ones"
                data |= {"reason": why, "retryable": True}
            else:
                data |= {"reason": event.reason, "retryable": event.retryable}
            self._tell(conversation, StreamEvent("interrupted", data))
        elif isinstance(event, OUTCOME_TYPES):
            conversation = self._conversations.get(event.conversation_id)
            if conversation is None:
                self._end_run(event.run_id)
                return
            conversation.held_outcome = StreamEvent("outcome", orjson.loads(event.model_dump_json()))
            reply = conversation.reply
            ours = reply is not None and reply.run_id == event.run_id
            # Not one delta of its run seen yet: a reply streamed in one burst has its outcome
            # read first as often as not, and its deltas, once late, were dropped (a reader got
            # the outcome alone). Held for whoever reads: a run with no deltas costs hold_s.
            unseen = not ours and bool(conversation.subscribers)
            if (ours and reply is not None and reply.open_iterations) or unseen:
                loop = asyncio.get_running_loop()
                conversation.release = loop.call_later(self._hold_s, self._release, event.conversation_id)
            else:
                self._release(event.conversation_id)

    async def run(self, deltas: Follow, events: Follow) -> None:
        """Follows both topics until cancelled."""
        try:
            await asyncio.gather(self._follow_deltas(deltas), self._follow_events(events))
        except Exception:
            log.exception("the reply hub stopped: streams get no more replies")
            raise

    # -- internals ------------------------------------------------------------------------------------

    async def _follow_deltas(self, follow: Follow) -> None:
        async for record in follow():
            delta = decode_delta(record.value)
            if delta is not None:
                self.on_delta(delta)

    async def _follow_events(self, follow: Follow) -> None:
        async for record in follow():
            if record.value is None:
                continue
            event = decode_record(record.key, record.value)  # as the workers fold it
            if not isinstance(event, DecodeError):
                self.on_event(event)

    def _release(self, conversation_id: str) -> None:
        conversation = self._conversations.get(conversation_id)
        if conversation is None or conversation.held_outcome is None:
            return
        if conversation.release is not None:
            conversation.release.cancel()
        outcome, conversation.held_outcome, conversation.release = conversation.held_outcome, None, None
        self._end_run(str(outcome.data["run_id"]))  # its deltas from now on are late
        conversation.reply = None
        self._tell(conversation, outcome)
        self._forget_if_idle(conversation_id)

    def _end_run(self, run_id: str) -> None:
        self._ended[run_id] = None
        while len(self._ended) > ENDED_RUNS_KEPT:
            self._ended.popitem(last=False)

    def _tell(self, conversation: _Conversation, event: StreamEvent) -> None:
        for queue in conversation.subscribers:
            queue.put_nowait(event)

    def _forget_if_idle(self, conversation_id: str) -> None:
        conversation = self._conversations[conversation_id]
        if not conversation.subscribers and conversation.reply is None and conversation.held_outcome is None:
            del self._conversations[conversation_id]


def _ids(reply: _Reply) -> dict[str, Any]:
    return {"turn_id": reply.turn_id, "run_id": reply.run_id, "attempt": reply.attempt}
