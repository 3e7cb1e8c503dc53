"""Runs one logical turn: the claim, its attempts and the explicit model loop, appending
every step to the log before acting on it.

The runner keeps a private copy of the conversation and folds each event it writes into
it with the same `apply_event` every reader uses, so what it believes is exactly what the
log will say; an event the fold would reject is a bug and is never written.

One iteration is one provider response followed by zero or more tool results. Before each
request the budget is checked (cost and time pause the turn; past the soft threshold older
tool exchanges are compacted); before each tool call the call is validated (protocol
failures go back to the model as tool errors, repeats change strategy, then stop the turn)
and the budget is checked again (a hard limit pauses before the tool runs). A tool that
needs approval pauses the turn. `ToolCallStarted` is on the log before a tool runs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from turnstile.events import (
    AttemptFailed,
    AttemptStarted,
    ContextCompacted,
    Event,
    FallbackEngaged,
    ModelResponded,
    ProtocolFailure,
    ToolCall,
    ToolCallFinished,
    ToolCallStarted,
)
from turnstile.events.outcomes import PauseReason
from turnstile.handlers import outcomes
from turnstile.handlers.budget import (
    Limit,
    Spent,
    TurnBudget,
    cancelled_at_deadline,
    hard_limit,
    input_token_bound,
    output_allowance,
    soft_dimension,
    spending_limit,
    time_left_s,
)
from turnstile.handlers.claim import ClaimPlan, claim_event
from turnstile.handlers.compaction import compact_tool_exchanges
from turnstile.handlers.context import build_context
from turnstile.handlers.failure_text import provider_failure
from turnstile.handlers.fallback import FallTo, RouteInfo, next_route
from turnstile.handlers.pricing import DEFAULT_PRICES, PriceTable, cost_usd
from turnstile.handlers.protocol import RepeatPolicy, repeated_call_error, tool_error
from turnstile.handlers.provider import ChatMessage, ModelReply, ModelRequest, Provider, ProviderError, ToolSpec
from turnstile.handlers.resume import Recovery, Resume, Unresumable, idempotency_key, next_step
from turnstile.handlers.stops import AskAgain, Complete, CutOff, Refused, after_reply
from turnstile.handlers.tools import InvalidCall, ToolRegistry, ValidCall, call_signature, validate_call
from turnstile.projections import ActiveTurn, ConversationState, apply_event
from turnstile.streams.reply_deltas import ReplyStreams

log = logging.getLogger(__name__)


class AppendEvent(Protocol):
    """Appends one event to the log. `wait=False` returns once the event is in the log's
    order, without its acknowledgement; the next append that waits waits for both."""

    def __call__(self, event: Event, wait: bool = True) -> Awaitable[None]: ...


RESULT_EXCERPT_CHARS = 300
# A tool result is recorded in ToolCallFinished: keep it well inside one log value.
MAX_RESULT_CHARS = 100_000


@dataclass(frozen=True, slots=True)
class Route:
    """A model and the provider that serves it: one link of the fallback chain."""

    model: str
    provider: Provider


@dataclass(frozen=True, slots=True)
class TurnSettings:
    model: str = "scripted-1"
    system_prompt: str | None = "You are a helpful assistant. Answer the user's latest messages."
    max_attempts: int = 3
    backoff_base_ms: int = 250
    backoff_max_ms: int = 4000
    budget: TurnBudget = field(default_factory=TurnBudget)
    prices: PriceTable = field(default_factory=lambda: dict(DEFAULT_PRICES))
    tools: ToolRegistry = field(default_factory=ToolRegistry)
    # Models tried after `model`, in order, when it fails mid-attempt (same family only).
    fallbacks: tuple[Route, ...] = ()
    repeats: RepeatPolicy = field(default_factory=RepeatPolicy)
    tool_timeout_s: float = 60.0
    max_output_tokens: int = 1024

    def backoff_s(self, attempt: int, error: ProviderError | None = None) -> float:
        """Exponential and bounded, so a provider outage does not become a retry storm. The
        wait a server asked for is honoured: the transport has already refused (made the
        error final) any wait longer than its policy or the deadline allows."""
        delay_ms = float(min(self.backoff_max_ms, self.backoff_base_ms * 2 ** (attempt - 1)))
        if error is not None and error.retry_after_s is not None:
            delay_ms = max(delay_ms, error.retry_after_s * 1000)
        return delay_ms / 1000


class _AttemptError(Exception):
    """The model could not be reached for this attempt, fallbacks included."""

    def __init__(self, error: ProviderError, reason: str) -> None:
        super().__init__(reason)
        self.error = error
        self.reason = reason


@dataclass(slots=True)
class _Done:
    """Results of the tools this attempt ran: what a pause keeps."""

    tool: str
    arguments: str
    ok: bool
    result: str


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
    ) -> None:
        self.state = state
        # The conversation's history as messages, kept by the worker across turns (see
        # `build_context`); a runner of its own renders the history it needs once.
        self._rendered = rendered if rendered is not None else []
        # Where the text of each reply streams to while it arrives (None: not streamed).
        self._replies = replies
        self._append = append
        self._settings = settings
        self._now_ms = now_ms
        self._new_id = new_id
        self._routes = (Route(settings.model, provider), *settings.fallbacks)
        self._route_infos = tuple(RouteInfo(r.model, r.provider.family) for r in self._routes)
        self._route = 0
        self._done: dict[str, _Done] = {}
        self._last_text: str | None = None
        # Approvals already used: one approval lets exactly one call run.
        self._grants_used: set[str] = set()

    @property
    def turn(self) -> ActiveTurn:
        assert self.state.active is not None, "the runner always holds an active turn"
        return self.state.active

    async def claim_and_run(self, plan: ClaimPlan) -> None:
        # Sent with AttemptStarted, which follows at once: one round trip for both.
        await self._emit(
            claim_event(self.state, plan, event_id=self._new_id(), run_id=self._new_id(), now_ms=self._now_ms()),
            wait=False,
        )
        await self._guarded(self._attempts(first=True))

    async def recover(self) -> None:
        """Take over a turn whose owner stopped mid-attempt (crash, lost partition)."""
        await self._guarded(self._recover())

    async def _recover(self) -> None:
        turn = self.turn
        step = next_step(turn.journal, self._recovery_of)
        if turn.attempt_state != "closed":
            # Retryable says a replay from scratch may follow: never after a side effect
            # started. Continuing the journal is not a replay (see `handlers/resume.py`).
            reason = "the worker running this attempt stopped before it ended"
            await self._emit(AttemptFailed(**self._stamp(), reason=reason, retryable=not turn.side_effect_started))
        unsafe = turn.side_effect_started and not isinstance(step, Resume)
        if isinstance(step, Unresumable):
            await self._fail(
                f"A tool with side effects ({step.call.tool}, call {step.call.call_id}) started before the worker "
                "stopped and cannot be run again safely; the turn was not resumed. Check the operation record "
                "before continuing."
            )
        elif unsafe:
            await self._fail(
                "A tool with side effects started before the worker stopped; the turn was not "
                "replayed. Check the operation record before continuing."
            )
        elif turn.attempt >= self._settings.max_attempts:
            await self._fail("The turn failed after the maximum number of attempts.")
        else:
            await self._attempts(first=False, resume=step if isinstance(step, Resume) else None)

    def _recovery_of(self, start: ToolCallStarted) -> Recovery:
        tool = self._settings.tools.get(start.tool, isolated=False)
        return tool.recovery if tool is not None else "none"

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

    # -- attempts ----------------------------------------------------------------------
    async def _attempts(self, first: bool, resume: Resume | None = None) -> None:
        while True:
            turn = self.turn
            run_id = turn.run_id if first else self._new_id()
            attempt = turn.attempt if first else turn.attempt + 1
            self._route, self._done, self._last_text = 0, {}, None
            await self._emit(
                AttemptStarted(
                    event_id=self._new_id(),
                    conversation_id=self.state.conversation_id,
                    occurred_at=self._now_ms(),
                    turn_id=turn.turn_id,
                    run_id=run_id,
                    attempt=attempt,
                    model=self._routes[0].model,
                    resumes_run_id=turn.run_id if resume is not None else None,
                )
            )
            try:
                await self._iterate(resume)
                return
            except _AttemptError as failure:
                err = failure.error
                unsafe = turn.side_effect_started
                retry = err.retryable and attempt < self._settings.max_attempts and not unsafe
                await self._emit(AttemptFailed(**self._stamp(), reason=failure.reason, retryable=retry))
                if not retry:
                    await self._fail(provider_failure(err, attempts=attempt, side_effect_ran=unsafe))
                    return
                await asyncio.sleep(self._settings.backoff_s(attempt, err))
            first, resume = False, None

    # -- the loop ------------------------------------------------------------------------
    async def _iterate(self, resume: Resume | None = None) -> None:
        turn = self.turn
        isolated = all(i.kind == "injected" and i.source == "schedule" for i in turn.inputs)
        tools = self._settings.tools.specs(isolated)
        budget = self._settings.budget
        messages: list[ChatMessage] = list(
            build_context(
                self.state.history, turn.history_boundary, turn.inputs, self._settings.system_prompt, self._rendered
            )
        )
        iteration = 0
        earlier = ""  # the text of paused parts of the reply being assembled
        if resume is not None:
            iteration = resume.iteration
            if not await self._continue(resume, messages, isolated):
                return
        while True:
            limit = spending_limit(self._spent(iteration), budget, self._model)
            if limit is not None:
                await self._pause(limit.dimension, limit.reason)
                return
            iteration += 1
            messages = await self._maybe_compact(messages, iteration)
            reply = await self._complete(tuple(messages), tools, iteration)
            if isinstance(reply, Limit):
                await self._pause(reply.dimension, reply.reason)
                return
            if reply.text:
                self._last_text = reply.text
            step = after_reply(reply, earlier)
            if isinstance(step, Complete):
                await self._emit(outcomes.completed(self.turn, self._next_stamp(), step.reply, self._model))
                return
            if isinstance(step, Refused):
                stamp = self._next_stamp()
                await self._emit(outcomes.failed(self.turn, stamp, step.error, self._model, step.reason, step.text))
                return
            if isinstance(step, CutOff):
                stamp = self._next_stamp()
                await self._emit(outcomes.exhausted(self.turn, stamp, step.text, self._model, "output_tokens"))
                return
            if iteration >= budget.max_iterations:
                # No iteration is left to read the results: the tools do not run.
                await self._emit(outcomes.exhausted(self.turn, self._next_stamp(), self._last_text, self._model))
                return
            messages.append(ChatMessage("assistant", reply.text or "", reply.tool_calls, native=reply.native))
            if isinstance(step, AskAgain):
                earlier += reply.text or ""
                continue
            for index, call in enumerate(reply.tool_calls):
                result = await self._handle_call(reply.tool_calls[index:], iteration, reply.model, isolated)
                if result is None:
                    return  # the call ended the turn
                text, ok = result
                messages.append(ChatMessage("tool", text, tool_call_id=call.call_id, is_error=not ok))

    async def _continue(self, resume: Resume, messages: list[ChatMessage], isolated: bool) -> bool:
        """Rebuild the transcript of the journal into `messages` and settle the calls of its
        last step that have no result; False when that ended the turn."""
        last = resume.steps[-1]
        for step in resume.steps:
            if step.text:
                self._last_text = step.text
            messages.append(ChatMessage("assistant", step.text or "", step.tool_calls))
            for index, call in enumerate(step.tool_calls):
                result = await self._resumed_call(resume, step.tool_calls[index:], step, isolated, step is last)
                if result is None:
                    return False
                text, ok = result
                messages.append(ChatMessage("tool", text, tool_call_id=call.call_id, is_error=not ok))
        return True

    async def _resumed_call(
        self, resume: Resume, calls: tuple[ToolCall, ...], step: ModelResponded, isolated: bool, last: bool
    ) -> tuple[str, bool] | None:
        """The result of `calls[0]` (the others follow it in the step) in the transcript."""
        call = calls[0]
        finished = resume.results.get(call.call_id)
        if finished is not None:
            self._done[call.call_id] = _Done(call.name, call.arguments, finished.ok, finished.result)
            return finished.result, finished.ok
        refused = resume.refused.get(call.call_id)
        if refused is not None:
            seen = self.turn.invalid_calls.get(refused.signature or "", 1)
            return tool_error(refused.detail, seen, self._settings.repeats), False
        how = resume.in_doubt.get(call.call_id)
        if how == "reconcile":
            return await self._reconcile(call, step.iteration)
        if how is not None or last:
            return await self._handle_call(calls, step.iteration, step.model, isolated)
        return "error: this call did not run.", False

    async def _reconcile(self, call: ToolCall, iteration: int) -> tuple[str, bool] | None:
        """Ask the tool whether a call interrupted mid-run acted, instead of running it again."""
        tool = self._settings.tools.get(call.name, isolated=False)
        assert tool is not None and tool.reconcile is not None, "next_step reconciles only with a reconciler"
        try:
            async with asyncio.timeout(self._settings.tool_timeout_s):
                result = await tool.reconcile(call)
        except Exception:
            log.exception("the reconciler of %s failed", call.name)
            result = None
        if result is None:
            await self._fail(
                f"A tool with side effects ({call.name}, call {call.call_id}) started before the worker stopped "
                "and its reconciler could not tell whether it ran. Check the operation record before continuing."
            )
            return None
        return await self._finish_call(call, iteration, True, result, reconciled=True)

    @property
    def _model(self) -> str:
        return self._routes[self._route].model

    def _spent(self, iterations: int) -> Spent:
        turn = self.turn
        return Spent(iterations, turn.tool_calls, turn.cost_usd, max(0, self._now_ms() - turn.claimed_at))

    async def _maybe_compact(self, messages: list[ChatMessage], iteration: int) -> list[ChatMessage]:
        dimension = soft_dimension(self._spent(iteration - 1), self._settings.budget)
        if dimension is None:
            return messages
        compacted, call_ids = compact_tool_exchanges(messages)
        if not call_ids:
            return messages
        await self._emit(
            ContextCompacted(**self._stamp(), iteration=iteration, compacted_call_ids=call_ids, dimension=dimension)
        )
        return list(compacted)

    async def _complete(
        self, messages: tuple[ChatMessage, ...], tools: tuple[ToolSpec, ...], iteration: int
    ) -> ModelReply | Limit:
        """One provider response, recorded. A failure moves down the fallback chain while the
        next model speaks the same protocol; otherwise the attempt fails. A Limit when the
        cost left cannot pay for a reply of this model, or the deadline came first."""
        budget = self._settings.budget
        while True:
            route = self._routes[self._route]
            spent = self._spent(iteration)
            price = self._settings.prices.get(route.model)
            wanted = self._settings.max_output_tokens
            allowance = output_allowance(spent, budget, route.model, price, input_token_bound(messages, tools), wanted)
            if isinstance(allowance, Limit):
                return allowance
            left_s = time_left_s(spent, budget)
            request = ModelRequest(route.model, messages, tools, allowance, left_s)
            turn = self.turn
            stream = (
                self._replies.open(self.state.conversation_id, turn.turn_id, turn.run_id, turn.attempt, iteration)
                if self._replies is not None
                else None
            )
            try:
                async with asyncio.timeout(left_s):
                    reply = await route.provider.complete(request, stream)
            except TimeoutError:
                if stream is not None:
                    await stream.restart()
                return Limit(
                    "deadline", f"the time limit ({budget.deadline_ms / 1000:g} s) was reached during a model request"
                )
            except ProviderError as err:
                if stream is not None:
                    await stream.restart()  # what this model streamed is no part of the reply
                if err.kind == "malformed_response":
                    await self._emit(
                        ProtocolFailure(
                            **self._stamp(),
                            iteration=iteration,
                            model=route.model,
                            kind="malformed_response",
                            detail=err.message,
                        )
                    )
                decision = next_route(self._route_infos, self._route, err.kind)
                if not isinstance(decision, FallTo):
                    raise _AttemptError(err, f"{err}; {decision.reason}") from None
                to_model = self._routes[decision.index].model
                await self._emit(
                    FallbackEngaged(**self._stamp(), from_model=route.model, to_model=to_model, reason=decision.reason)
                )
                self._route = decision.index
                continue
            if stream is not None:
                await stream.finish()
            await self._emit(
                ModelResponded(
                    **self._stamp(),
                    iteration=iteration,
                    model=reply.model,
                    text=reply.text,
                    # Secret tool arguments are redacted on the log; the tools get the values.
                    tool_calls=tuple(map(self._settings.tools.recorded, reply.tool_calls)),
                    usage=reply.usage,
                    cost_usd=cost_usd(self._settings.prices, reply.model, reply.usage, route.model),
                    finish_reason=reply.finish_reason,
                ),
                # A final reply is followed at once by the outcome (see `_iterate`): one
                # round trip for both. Tool calls wait (a tool may act), and so does a
                # paused reply (another request follows).
                wait=bool(reply.tool_calls) or reply.stop == "pause",
            )
            return reply

    async def _handle_call(
        self, calls: tuple[ToolCall, ...], iteration: int, model: str, isolated: bool
    ) -> tuple[str, bool] | None:
        """The tool result the model reads next and whether the call succeeded, or None
        when this call ended the turn. `calls`: this call and those after it in the reply,
        which a pause records as blocked."""
        call = calls[0]
        checked = validate_call(self._settings.tools, call, isolated)
        if isinstance(checked, InvalidCall):
            return await self._invalid_call(checked, iteration, model)
        limit = hard_limit(self._spent(iteration), self._settings.budget, self._model)
        if limit is not None:
            await self._pause(limit.dimension, limit.reason, calls)
            return None
        if checked.tool.needs_approval:
            approved = self._approval_of(checked)
            if approved is None:
                await self._pause_for_approval(checked.call, calls[1:])
                return None
            if not approved:
                return "error: the user denied this call; it did not run. Do not call it again.", False
        return await self._run_tool(checked, iteration, calls[1:])

    async def _invalid_call(self, invalid: InvalidCall, iteration: int, model: str) -> tuple[str, bool] | None:
        call, policy = invalid.call, self._settings.repeats
        common = {"iteration": iteration, "model": model, "call_id": call.call_id, "signature": invalid.signature}
        await self._emit(ProtocolFailure(**self._stamp(), **common, kind=invalid.kind, detail=invalid.detail))
        seen = self.turn.invalid_calls.get(invalid.signature, 0)
        action = policy.action(seen)
        if action == "report":
            return tool_error(invalid.detail, seen, policy), False
        what = "the turn was stopped" if action == "stop" else "a strategy-change instruction was sent"
        detail = f"the same invalid call to {call.name!r} was made {seen} times; {what}"
        await self._emit(ProtocolFailure(**self._stamp(), **common, kind="repeated_call", detail=detail))
        if action == "stop":
            await self._fail(repeated_call_error(call.name, call.arguments, seen))
            return None
        return tool_error(invalid.detail, seen, policy), False

    def _approval_of(self, checked: ValidCall) -> bool | None:
        """The decision of an approval claimed by this turn on exactly this call (same tool,
        same normalized arguments), if any. An approval lets one call run, not a series."""
        for item in self.turn.inputs:
            grant = item.grant
            if grant is None or call_signature(grant.tool, grant.arguments) != checked.signature:
                continue
            if not grant.approved:
                return False
            if grant.call_id not in self._grants_used:
                self._grants_used.add(grant.call_id)
                return True
        return None

    async def _run_tool(
        self, checked: ValidCall, iteration: int, after: tuple[ToolCall, ...]
    ) -> tuple[str, bool] | None:
        """The result, or None when the deadline cancelled the tool and paused the turn."""
        call, tool = checked.call, checked.tool
        key = idempotency_key(self.turn.turn_id, call.call_id) if tool.idempotent else None
        left_s = time_left_s(self._spent(iteration), self._settings.budget)
        timeout_s = min(self._settings.tool_timeout_s, left_s)
        # On the log, acknowledged, before the tool can touch anything.
        started = ToolCallStarted(
            **self._stamp(),
            iteration=iteration,
            call_id=call.call_id,
            tool=tool.name,
            arguments=call.arguments,
            side_effect=tool.side_effect,
            idempotency_key=key,
        )
        try:
            await self._emit(started)
        except asyncio.CancelledError:
            await self._record_not_started(started)
            raise
        # Nothing awaits between the acknowledgement and the body's first step, so a
        # revoke cannot land between them: it lands before (recorded above) or inside.
        try:
            async with asyncio.timeout(timeout_s):
                body = tool.run(checked.arguments, key) if tool.idempotent else tool.run(checked.arguments)
                result, ok = await body, True
        except TimeoutError:
            if timeout_s == left_s:
                await self._cancelled_at_deadline(checked, iteration, after)
                return None
            result, ok = f"error: the tool did not finish within {timeout_s:g} s", False
        except Exception as exc:
            result, ok = f"error: {type(exc).__name__}: {exc}", False
        if not isinstance(result, str):
            result, ok = f"error: the tool returned {type(result).__name__}, not text", False
        return await self._finish_call(call, iteration, ok, result)

    async def _finish_call(
        self, call: ToolCall, iteration: int, ok: bool, result: str, reconciled: bool = False
    ) -> tuple[str, bool]:
        if len(result) > MAX_RESULT_CHARS:
            result = result[:MAX_RESULT_CHARS] + f"\n[truncated: the result had {len(result)} characters]"
        finished = ToolCallFinished(
            **self._stamp(), iteration=iteration, call_id=call.call_id, ok=ok, result=result, reconciled=reconciled
        )
        await self._emit(finished)
        self._done[call.call_id] = _Done(call.name, call.arguments, ok, result)
        return result, ok

    async def _record_not_started(self, started: ToolCallStarted) -> None:
        """The run was stopped (revoke, drain) while its ToolCallStarted was being
        acknowledged: the body never began. Say so on the log, best effort, so the next
        owner reads a failed call that did not run instead of an unknown one. A run that
        was superseded is refused by every reader anyway; a dead process writes nothing."""
        if self.state.active is None or started.call_id not in self.turn.operations:
            return
        result = "error: the call did not start (the worker stopped before running it); it had no effect"
        finished = ToolCallFinished(
            **self._stamp(), iteration=started.iteration, call_id=started.call_id, ok=False, result=result
        )
        try:
            # Not waited for: the run is stopping, and a superseded run's write is refused
            # by every reader anyway; what reaches the log before the takeover counts.
            await self._emit(finished, wait=False)
        except Exception:
            log.warning("could not record that call %s did not start", started.call_id)

    async def _cancelled_at_deadline(self, checked: ValidCall, iteration: int, after: tuple[ToolCall, ...]) -> None:
        call, tool = checked.call, checked.tool
        failure = cancelled_at_deadline(tool.side_effect)
        if failure is not None:
            await self._emit(
                ToolCallFinished(**self._stamp(), iteration=iteration, call_id=call.call_id, ok=False, result=failure)
            )
        status = failure or "cancelled at the deadline; it may or may not have acted (status unknown)"
        self._done[call.call_id] = _Done(tool.name, call.arguments, False, status)
        why = f"the time limit ({self._settings.budget.deadline_ms / 1000:g} s) was reached while {tool.name} ran"
        await self._pause("deadline", why, after)

    # -- outcomes ----------------------------------------------------------------------
    async def _pause(self, reason: PauseReason, why: str, blocked: tuple[ToolCall, ...] = ()) -> None:
        blocked = self._recorded(blocked)
        hint = (
            f"Paused because {why}. The completed work is kept above. To continue, run `turnstile resume "
            f"{self.state.conversation_id}` (a ResumeRequested with resumes_turn_id={self.turn.turn_id}): it starts a "
            "new turn with a fresh budget that sees this one."
        )
        stamp = self._next_stamp()
        kept = self._kept(blocked)
        await self._emit(outcomes.paused(self.turn, stamp, reason, kept, hint, self._model, blocked_calls=blocked))

    async def _pause_for_approval(self, call: ToolCall, blocked: tuple[ToolCall, ...]) -> None:
        blocked = self._recorded(blocked)
        turn = self.turn
        waiting = f"Waiting for approval to call {call.name} with arguments {call.arguments} (call {call.call_id})."
        kept = f"{self._kept(blocked)}\n{waiting}".strip()
        hint = (
            f"Approve or deny it with `turnstile approve|deny {self.state.conversation_id} {call.call_id}` (an "
            f"InputInjected of source 'approval' carrying approval={{turn_id: {turn.turn_id}, call_id: "
            f"{call.call_id}, approved: true|false}}); it starts a new turn that sees this request."
        )
        stamp = self._next_stamp()
        await self._emit(outcomes.paused(turn, stamp, "approval", kept, hint, self._model, call, blocked))

    def _recorded(self, calls: tuple[ToolCall, ...]) -> tuple[ToolCall, ...]:
        """Calls as the log keeps them: their tools' secret arguments redacted."""
        return tuple(self._settings.tools.recorded(c) for c in calls)

    def _kept(self, blocked: tuple[ToolCall, ...] = ()) -> str:
        """What a paused turn keeps: the reply so far, the tools that ran, with results, and
        the calls requested but not run (the resumed turn may make them again)."""
        lines = [self._last_text] if self._last_text else []
        if self._done:
            lines.append("Completed operations:")
            for done in self._done.values():
                result = done.result
                if len(result) > RESULT_EXCERPT_CHARS:
                    result = result[:RESULT_EXCERPT_CHARS] + "..."
                status = "ok" if done.ok else "failed"
                lines.append(f"- {done.tool}({done.arguments}) -> {status}: {result}")
        if blocked:
            lines.append("Requested but not run (the turn stopped first):")
            lines.extend(f"- {c.name}({c.arguments}) [call {c.call_id}]" for c in blocked)
        return "\n".join(lines)

    async def _fail(self, error: str) -> None:
        await self._emit(outcomes.failed(self.turn, self._next_stamp(), error, self._model))

    def _next_stamp(self) -> outcomes.Stamp:
        return outcomes.Stamp(self._new_id(), self.state.conversation_id, self._now_ms())

    def _stamp(self) -> dict[str, str | int]:
        return self._next_stamp().of(self.turn)

    async def _emit(self, event: Event, wait: bool = True) -> None:
        """Folds the event, then appends it. `wait=False` only where the next event is
        emitted at once, with nothing done outside the log in between."""
        rejection = apply_event(self.state, event)
        if rejection is not None:
            raise RuntimeError(f"refusing to write {event.type}: the fold rejects it ({rejection.reason})")
        await self._append(event, wait)
