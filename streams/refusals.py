"""The refusals a worker owes: `MessageRejected` for a message that arrived mid-turn under
the `reject` double-text policy, or for a resume that names no paused, failed or exhausted
turn (`handlers.claim.resume_refusal`).

A refused input is noted when it is folded (`note`); its refusal is written in the
background; until that refusal is folded back, the input is still pending, so the
conversation's next claim waits (`holds_back`): it must not take a message that is about
to be refused. An input claimed or refused by an earlier owner meanwhile is simply no
longer pending, and dropped. One writer per conversation at a time; a failed write is
tried again through `retry`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable

from turnstile.events import Event, MessageReceived, MessageRejected, ResumeRequested
from turnstile.handlers.claim import DoubleTextPolicy, Refusal, refusal_on_arrival
from turnstile.projections import ConversationState

log = logging.getLogger(__name__)

# Appends the refusal of one input of a conversation (its event made from the state).
WriteRefusal = Callable[[ConversationState, str, Refusal], Awaitable[None]]


class Refusals:
    def __init__(
        self, policy: DoubleTextPolicy, write: WriteRefusal, retry: Callable[[str], None], done: Callable[[str], None]
    ) -> None:
        self._policy = policy
        self._write = write
        self._retry = retry  # a write failed: decide for the conversation again later
        self._done = done  # the writer ended: decide for the conversation again now
        self._owed: dict[str, dict[str, Refusal]] = {}  # input id -> refusal still to write
        self._unfolded: dict[str, set[str]] = {}  # refused, refusal not folded back yet
        self._writers: dict[str, asyncio.Task[None]] = {}

    def note(self, state: ConversationState, event: Event) -> None:
        """An event was folded into `state`: a refusal to owe, or one folded back."""
        conversation = state.conversation_id
        refusal = refusal_on_arrival(self._policy, state, event)
        if refusal is not None:
            assert isinstance(event, (MessageReceived, ResumeRequested))
            input_id = event.message_id if isinstance(event, MessageReceived) else event.request_id
            self._owed.setdefault(conversation, {})[input_id] = refusal
            self._unfolded.setdefault(conversation, set()).add(input_id)
        elif isinstance(event, MessageRejected):
            self._owed.get(conversation, {}).pop(event.message_id, None)
            self._unfolded.get(conversation, set()).discard(event.message_id)

    def holds_back(self, state: ConversationState) -> bool:
        """Starts writing the refusals still owed; True while any is not folded back yet."""
        conversation = state.conversation_id
        unfolded = self._unfolded.get(conversation)
        if unfolded:
            unfolded.intersection_update(state.pending)  # claimed or refused by an earlier owner
        if not unfolded:
            self.forget(conversation)
            return False
        owed = {m: r for m, r in self._owed.get(conversation, {}).items() if m in unfolded}
        if owed and conversation not in self._writers:
            task = asyncio.create_task(self._write_all(state, owed), name=f"reject:{conversation}")
            self._writers[conversation] = task
            task.add_done_callback(lambda t: self._ended(conversation, t))
        return True

    async def _write_all(self, state: ConversationState, owed: dict[str, Refusal]) -> None:
        for input_id, refusal in owed.items():
            await self._write(state, input_id, refusal)
            self._owed.get(state.conversation_id, {}).pop(input_id, None)

    def _ended(self, conversation: str, task: asyncio.Task[None]) -> None:
        self._writers.pop(conversation, None)
        if not task.cancelled() and task.exception() is not None:
            log.warning("writing refusals for %s failed (tried again soon): %r", conversation, task.exception())
            self._retry(conversation)
        else:
            self._done(conversation)

    def owes(self, conversation: str) -> bool:
        """A refusal of it is still to be written or folded back: the worker's alone, not in
        the conversation's state."""
        return bool(self._unfolded.get(conversation)) or conversation in self._writers

    def writers(self, conversations: Iterable[str] | None = None) -> list[asyncio.Task[None]]:
        """The writers in flight (of these conversations)."""
        if conversations is None:
            return list(self._writers.values())
        return [t for c in conversations if (t := self._writers.get(c)) is not None]

    def forget(self, conversation: str) -> None:
        self._owed.pop(conversation, None)
        self._unfolded.pop(conversation, None)
