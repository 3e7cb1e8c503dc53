"""Runs one logical turn: the executor of the turn's state machine.

Every decision is `handlers.turn_machine.decide`'s: this module carries out the commands
it returns -- appends events to the log, calls the model, runs a tool or its reconciler,
sleeps out a backoff -- and feeds what it saw back as the next observation, with the time.
It reads the clock and draws ids for the machine; it decides nothing.

Fencing stays where the log is read: the worker's runner slot stops the run (raises
`Superseded`) when its side-effecting `ToolCallStarted` is read back refused, and a
superseded run writes nothing more. A cancellation (a drain's second signal) while that
start is being acknowledged is recorded, best effort, as a side-effecting call that did not
start (`handlers.turn_machine`; a read-only one is left for the next owner to run).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from turnstile.events import Event, MessageReceived, ToolCallStarted, TurnExhausted, TurnFailed, TurnPaused
from turnstile.handlers.claim import ClaimPlan
from turnstile.handlers.provider import ChatMessage, Provider, ProviderError
from turnstile.handlers.tools import NotRun
from turnstile.handlers.turn_machine import TurnMachine, decide, interruptible, machine_for
from turnstile.handlers.turn_settings import Route, TurnSettings
from turnstile.handlers.turn_steps import (
    Append,
    CallModel,
    Claimed,
    Command,
    Crashed,
    Effect,
    Finish,
    Interrupted,
    ModelAnswered,
    ModelCutOff,
    ModelFailed,
    Observation,
    Reconcile,
    Reconciled,
    Report,
    RunTool,
    SleepUntil,
    TakenOver,
    ToolNotStarted,
    ToolRaised,
    ToolReturned,
    ToolTimedOut,
    Woke,
)
from turnstile.projections import ConversationState
from turnstile.projections.inert import printable
from turnstile.streams.reply_deltas import ReplyStreams

__all__ = ["AppendEvent", "Route", "StepHook", "TurnRunner", "TurnSettings"]

log = logging.getLogger(__name__)


def _log_outcome(event: Event) -> None:
    """A turn that ends without its answer is said in the worker's log too, not only on the
    log of events (a wrong base_url failed every turn with nothing in the worker's output).
    Ids and errors are a client's or a provider's text: printed inert (no forged lines)."""
    match event:
        case TurnFailed():
            log.warning("turn %s of %s failed (%s): %s", event.turn_id, printable(event.conversation_id),
                        event.reason or "error", printable(event.error))  # fmt: skip
        case TurnExhausted():
            log.info("turn %s of %s stopped: its %s allowance is used up", event.turn_id,
                     printable(event.conversation_id), event.allowance)  # fmt: skip
        case TurnPaused():
            log.info("turn %s of %s paused (%s)", event.turn_id, printable(event.conversation_id), event.reason)


class AppendEvent(Protocol):
    """Appends one event to the log, as `value` when given (its encoding, already made).
    `wait=False` returns once the event is in the log's order, without its acknowledgement;
    the next append that waits waits for both."""

    def __call__(self, event: Event, wait: bool = True, value: bytes | None = None) -> Awaitable[None]: ...


# Told of every step once its appends are on the log: what was observed, what was decided
# (the replays in tests/replays are recorded so).
StepHook = Callable[[Observation, tuple[Command, ...]], None]


class TurnRunner:
    def __init__(
        self,
        state: ConversationState,
        append: AppendEvent,
        provider: Provider,
        settings: TurnSettings,
        now_ms: Callable[[], int],
        new_id: Callable[[], str],
        rendered: list[ChatMessage] | None = None,
        replies: ReplyStreams | None = None,
        on_step: StepHook | None = None,
        max_event_bytes: int | None = None,
    ) -> None:
        """`max_event_bytes`: the largest event value the log takes for this conversation."""
        self.machine: TurnMachine = machine_for(state, settings, provider.family, new_id, rendered, max_event_bytes)
        self._providers = (provider, *(r.provider for r in settings.fallbacks))
        self._append = append
        self._now_ms = now_ms
        # Where the text of each reply streams to while it arrives (None: not streamed).
        self._replies = replies
        self._on_step = on_step
        # Interrupt-and-merge: the task running the turn, whether it is inside an effect
        # (a model call, a tool, a backoff), and the message that asked the turn to stop.
        self._task: asyncio.Task[None] | None = None
        self._in_effect = False
        self._interrupt: MessageReceived | None = None

    @property
    def state(self) -> ConversationState:
        return self.machine.state

    async def claim_and_run(self, plan: ClaimPlan) -> None:
        await self._run(Claimed(plan, self._now_ms()))

    async def recover(self) -> None:
        """Take over a turn whose owner stopped mid-attempt (crash, lost partition)."""
        await self._run(TakenOver(self._now_ms()))

    def interrupt(self, message: MessageReceived) -> bool:
        """`message` arrived under the `interrupt` double-text policy. True when the turn
        will be withdrawn (the effect in flight, if any, is cancelled; `TurnInterrupted`
        follows); False when it runs on, the message waiting for the next turn as under
        `enqueue`, because a side-effecting call has started (or the turn is ending)."""
        if self._interrupt is not None:
            return True
        if not interruptible(self.machine):
            return False
        self._interrupt = message
        if self._in_effect and self._task is not None:
            self._task.cancel()
        return True

    async def _run(self, seen: Observation) -> None:
        self._task = asyncio.current_task()
        while True:
            commands = decide(self.machine, seen)
            try:
                effect = await self._append_all(commands)
            except Exception as exc:
                if isinstance(seen, Crashed):
                    raise  # failing the turn failed too: the next owner will take it over
                log.exception("a turn of %s could not write its events", self.state.conversation_id)
                seen = Crashed(f"{type(exc).__name__}: {exc}", self._now_ms())
                continue
            if self._on_step is not None:
                self._on_step(seen, commands)
            if effect is None:
                return
            if self._interrupt is not None:
                seen = Interrupted(self._interrupt, self._now_ms())  # asked while the step was written
                continue
            seen = await self._interruptible(effect)

    async def _interruptible(self, effect: Effect) -> Observation:
        self._in_effect = True
        try:
            return await self._carry_out(effect)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            # Only our own cancel is an interruption; a revoke or drain (as well) stops the run.
            if self._interrupt is None or task is None or task.cancelling() > 1:
                raise
            task.uncancel()
            return Interrupted(self._interrupt, self._now_ms())
        finally:
            self._in_effect = False

    async def _append_all(self, commands: tuple[Command, ...]) -> Effect | None:
        """Appends the step's events in order; the effect to carry out next, if any."""
        for command in commands:
            match command:
                case Append(event=event, wait=wait, value=value):
                    try:
                        await self._append(event, wait, value)
                    except asyncio.CancelledError:
                        if isinstance(event, ToolCallStarted):
                            await self._stopped_before_tool()
                        raise
                    _log_outcome(event)
                case Report(message=message):
                    log.error("%s", message)
                case Finish():
                    return None
                case _:
                    return command
        return None

    async def _stopped_before_tool(self) -> None:
        """The run was stopped (revoke, drain, superseded) while a tool's start was being
        acknowledged: what the machine records for that is written, best effort."""
        seen = ToolNotStarted(self._now_ms())
        commands = decide(self.machine, seen)
        if self._on_step is not None:
            self._on_step(seen, commands)
        for command in commands:
            if isinstance(command, Append):
                try:
                    await self._append(command.event, False, command.value)
                except Exception:
                    log.warning("could not record that a call of %s did not start", self.state.conversation_id)

    async def _carry_out(self, effect: Effect) -> Observation:
        try:
            match effect:
                case CallModel():
                    return await self._call_model(effect)
                case RunTool():
                    return await self._run_tool(effect)
                case Reconcile():
                    return await self._reconcile(effect)
                case SleepUntil(due_ms=due_ms):
                    await asyncio.sleep(max(0, due_ms - self._now_ms()) / 1000)
                    return Woke(self._now_ms())
        except Exception as exc:
            log.exception("a turn of %s hit an internal error", self.state.conversation_id)
            return Crashed(f"{type(exc).__name__}: {exc}", self._now_ms())

    async def _call_model(self, effect: CallModel) -> Observation:
        turn = self.machine.turn
        stream = (
            self._replies.open(self.state.conversation_id, turn.turn_id, turn.run_id, turn.attempt, effect.iteration)
            if self._replies is not None
            else None
        )
        try:
            async with asyncio.timeout(effect.request.time_left_s):
                reply = await self._providers[effect.route].complete(effect.request, stream)
        except (TimeoutError, ProviderError) as exc:
            if stream is not None:
                await stream.restart()  # what this model streamed is no part of the reply
            if isinstance(exc, ProviderError):
                return ModelFailed(exc, self._now_ms())
            return ModelCutOff(self._now_ms())
        if stream is not None:
            await stream.finish()
        return ModelAnswered(reply, self._now_ms())

    async def _run_tool(self, effect: RunTool) -> Observation:
        started = effect.started
        tool = self.machine.settings.tools.get(started.tool, isolated=False)
        assert tool is not None, "the machine runs only tools of its registry"
        # Nothing awaits between the acknowledgement of ToolCallStarted and the body's first
        # step, so a revoke cannot land between them: it lands before (recorded) or inside.
        try:
            async with asyncio.timeout(effect.timeout_s):
                key = started.idempotency_key
                result = await (tool.run(effect.arguments, key) if tool.idempotent else tool.run(effect.arguments))
        except TimeoutError:
            return ToolTimedOut(self._now_ms())
        except Exception as exc:
            # The model reads the error; the developer needs where it came from.
            log.warning("tool %s raised in a turn of %s (the model is told): %s", started.tool,
                        printable(self.state.conversation_id), printable(repr(exc)), exc_info=exc)  # fmt: skip
            return ToolRaised(f"{type(exc).__name__}: {exc}", self._now_ms())
        if isinstance(result, str):
            return ToolReturned(result, self._now_ms())
        return ToolReturned(None, self._now_ms(), type(result).__name__)

    async def _reconcile(self, effect: Reconcile) -> Observation:
        """Ask the tool whether a call interrupted mid-run acted, instead of running it again."""
        tool = self.machine.settings.tools.get(effect.call.name, isolated=False)
        assert tool is not None and tool.reconcile is not None, "the machine reconciles only with a reconciler"
        try:
            async with asyncio.timeout(effect.timeout_s):
                result = await tool.reconcile(effect.call)
        except Exception:
            log.exception("the reconciler of %s failed", effect.call.name)
            result = None
        if result is not None and not isinstance(result, str | NotRun):
            log.error("the reconciler of %s returned a %s, not text, NOT_RUN or None", effect.call.name,
                      type(result).__name__)  # fmt: skip
            result = None  # it cannot tell, as far as anyone can read
        return Reconciled(result, self._now_ms())
