"""Runs one logical turn: the claim, its attempts and the explicit model loop, appending
every step to the log before acting on it.

The runner keeps a private copy of the conversation and folds each event it writes into
it with the same `apply_event` every reader uses, so what it believes is exactly what the
log will say; an event the fold would reject is a bug and is never written.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from events import AttemptFailed, AttemptStarted, Event, ModelResponded, ProtocolFailure
from handlers import outcomes
from handlers.claim import ClaimPlan, claim_event
from handlers.context import build_context
from handlers.provider import ChatMessage, ModelRequest, Provider, ProviderError
from projections import ActiveTurn, ConversationState, apply_event

log = logging.getLogger(__name__)

AppendEvent = Callable[[Event], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class TurnSettings:
    model: str = "scripted-1"
    system_prompt: str | None = "You are a helpful assistant. Answer the user's latest messages."
    max_iterations: int = 8
    max_attempts: int = 3
    backoff_base_ms: int = 250
    backoff_max_ms: int = 4000

    def backoff_s(self, attempt: int) -> float:
        """Exponential and bounded, so a provider outage does not become a retry storm."""
        return min(self.backoff_max_ms, self.backoff_base_ms * 2 ** (attempt - 1)) / 1000


class TurnRunner:
    def __init__(
        self,
        state: ConversationState,
        append: AppendEvent,
        provider: Provider,
        settings: TurnSettings,
        now_ms: Callable[[], int],
        new_id: Callable[[], str],
    ) -> None:
        self.state = state
        self._append = append
        self._provider = provider
        self._settings = settings
        self._now_ms = now_ms
        self._new_id = new_id

    @property
    def turn(self) -> ActiveTurn:
        assert self.state.active is not None, "the runner always holds an active turn"
        return self.state.active

    async def claim_and_run(self, plan: ClaimPlan) -> None:
        await self._emit(
            claim_event(self.state, plan, event_id=self._new_id(), run_id=self._new_id(), now_ms=self._now_ms())
        )
        await self._guarded(self._attempts(first=True))

    async def recover(self) -> None:
        """Take over a turn whose owner stopped mid-attempt (crash, lost partition)."""
        await self._guarded(self._recover())

    async def _recover(self) -> None:
        turn = self.turn
        unsafe = turn.side_effect_started
        if turn.attempt_state != "closed":
            reason = "the worker running this attempt stopped before it ended"
            await self._emit(AttemptFailed(**self._stamp(), reason=reason, retryable=not unsafe))
        if unsafe:
            await self._fail(
                "A tool with side effects started before the worker stopped; the turn was not "
                "replayed. Check the operation record before continuing."
            )
        elif turn.attempt >= self._settings.max_attempts:
            await self._fail("The turn failed after the maximum number of attempts.")
        else:
            await self._attempts(first=False)

    async def _guarded(self, work: Awaitable[None]) -> None:
        """Any unexpected error still ends the turn with a durable, visible outcome."""
        try:
            await work
        except (asyncio.CancelledError, KeyboardInterrupt):
            raise
        except Exception as exc:
            log.exception("a turn of %s hit an internal error", self.state.conversation_id)
            if self.state.active is None:
                return  # the outcome was decided; whether it reached the log, the next owner will see
            if self.turn.attempt_state == "open":
                await self._emit(AttemptFailed(**self._stamp(), reason=f"internal error: {exc}", retryable=False))
            await self._fail("The turn failed because of an internal error.")

    async def _attempts(self, first: bool) -> None:
        while True:
            turn = self.turn
            run_id = turn.run_id if first else self._new_id()
            attempt = turn.attempt if first else turn.attempt + 1
            await self._emit(
                AttemptStarted(
                    event_id=self._new_id(),
                    conversation_id=self.state.conversation_id,
                    occurred_at=self._now_ms(),
                    turn_id=turn.turn_id,
                    run_id=run_id,
                    attempt=attempt,
                    model=self._settings.model,
                )
            )
            try:
                await self._iterate()
                return
            except ProviderError as err:
                retry = err.retryable and attempt < self._settings.max_attempts and not turn.side_effect_started
                await self._emit(AttemptFailed(**self._stamp(), reason=str(err), retryable=retry))
                if not retry:
                    await self._fail(f"The model provider failed: {err.kind}.")
                    return
                await asyncio.sleep(self._settings.backoff_s(attempt))
            first = False

    async def _iterate(self) -> None:
        turn = self.turn
        messages: list[ChatMessage] = list(
            build_context(self.state.history, turn.history_boundary, turn.inputs, self._settings.system_prompt)
        )
        last_text: str | None = None
        for iteration in range(1, self._settings.max_iterations + 1):
            reply = await self._provider.complete(ModelRequest(self._settings.model, tuple(messages)))
            await self._emit(
                ModelResponded(
                    **self._stamp(),
                    iteration=iteration,
                    model=reply.model,
                    text=reply.text,
                    tool_calls=reply.tool_calls,
                    usage=reply.usage,
                    cost_usd=None,
                    finish_reason=reply.finish_reason,
                )
            )
            last_text = reply.text
            if not reply.tool_calls:
                await self._emit(
                    outcomes.completed(self.turn, self._next_stamp(), reply.text or "", self._settings.model)
                )
                return
            messages.append(ChatMessage("assistant", reply.text or "", tool_calls=reply.tool_calls))
            for call in reply.tool_calls:
                detail = f"tool {call.name!r} is not registered"
                await self._emit(
                    ProtocolFailure(
                        **self._stamp(),
                        iteration=iteration,
                        model=reply.model,
                        kind="unknown_tool",
                        detail=detail,
                        call_id=call.call_id,
                    )
                )
                messages.append(ChatMessage("tool", f"error: {detail}", tool_call_id=call.call_id))
        await self._emit(outcomes.exhausted(self.turn, self._next_stamp(), last_text, self._settings.model))

    async def _fail(self, error: str) -> None:
        await self._emit(outcomes.failed(self.turn, self._next_stamp(), error, self._settings.model))

    def _next_stamp(self) -> outcomes.Stamp:
        return outcomes.Stamp(self._new_id(), self.state.conversation_id, self._now_ms())

    def _stamp(self) -> dict[str, str | int]:
        return self._next_stamp().of(self.turn)

    async def _emit(self, event: Event) -> None:
        rejection = apply_event(self.state, event)
        if rejection is not None:
            raise RuntimeError(f"refusing to write {event.type}: the fold rejects it ({rejection.reason})")
        await self._append(event)
