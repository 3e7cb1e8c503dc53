"""The turn as a pure state machine: `decide(machine, observation) -> commands`.

The machine holds the conversation as the turn's events fold it (the same `apply_event`
every reader uses: each event it asks to append is folded first, and an event the fold
would refuse is a bug, never written) and the work of the attempt in progress: the
transcript sent to the model, the fallback link, the calls of the last reply still to
settle. No await, no clock, no randomness: the time comes with each observation and ids
from the `new_id` the machine is built with, so a recorded run replays to the same
commands (`tests/test_replays.py`).

One iteration is one model reply followed by zero or more tool results. Before each
request the budget is checked (cost and time pause the turn; past the soft threshold
older tool exchanges are compacted); before each tool call the call is validated
(protocol failures go back to the model as tool errors, repeats change strategy, then
stop the turn) and the budget is checked again (a hard limit pauses before the tool
runs). A tool that needs approval pauses the turn. `ToolCallStarted` is on the log
before a tool runs. A turn taken over from a stopped worker continues its journal
(`handlers/resume.py`).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from turnstile.events import (
    NOT_STARTED,
    STOPPED_MID_ATTEMPT,
    AttemptFailed,
    AttemptStarted,
    ContextCompacted,
    Event,
    FallbackEngaged,
    MessageReceived,
    ModelResponded,
    ProtocolFailure,
    ToolCall,
    ToolCallFinished,
    ToolCallStarted,
    TurnCompleted,
    TurnExhausted,
    TurnFailed,
    TurnInterrupted,
    TurnPaused,
    Usage,
    encode,
)
from turnstile.events.base import MAX_ID_CHARS
from turnstile.events.lifecycle import ProtocolFailureKind
from turnstile.events.outcomes import PauseReason
from turnstile.handlers import outcomes
from turnstile.handlers.budget import (
    CANCELLED_AT_DEADLINE,
    Spent,
    hard_limit,
    input_token_bound,
    output_allowance,
    soft_dimension,
    spending_limit,
    time_left_s,
)
from turnstile.handlers.claim import claim_event
from turnstile.handlers.compaction import compact_tool_exchanges
from turnstile.handlers.context import build_context
from turnstile.handlers.failure_text import (
    INTERNAL_ERROR,
    failed_by_owner,
    provider_failure,
    reconcile_unknown,
    too_large_to_record,
)
from turnstile.handlers.fallback import FallTo, RouteInfo, next_route
from turnstile.handlers.pauses import (
    DoneCall,
    approval_hint,
    deadline_reached,
    kept_in_brief,
    kept_work,
    resume_hint,
    waiting_for_approval,
)
from turnstile.handlers.pricing import cost_usd
from turnstile.handlers.protocol import repeated_call_error, tool_error
from turnstile.handlers.provider import ChatMessage, ModelReply, ModelRequest, ProtocolFamily, ProviderError, ToolSpec
from turnstile.handlers.resume import (
    Recovery,
    Resume,
    StartOver,
    idempotency_key,
    key_of_first_run,
    next_step,
    started_before,
)
from turnstile.handlers.stops import AskAgain, Complete, CutOff, Refused, RunTools, after_reply
from turnstile.handlers.tools import InvalidCall, NotRun, ValidCall, validate_call
from turnstile.handlers.turn_rules import (
    DENIED,
    DID_NOT_RUN,
    RECONCILED_NOT_RUN,
    approval_of,
    bounded_result,
    isolated_turn,
    owner_verdict,
    result_cut_to_fit,
    retries_after,
    takeover_failure,
    tool_outcome,
)
from turnstile.handlers.turn_settings import TurnSettings
from turnstile.handlers.turn_steps import (
    Append,
    CallModel,
    Claimed,
    Command,
    Crashed,
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
from turnstile.projections import ActiveTurn, ConversationState, apply_event


@dataclass(frozen=True, slots=True)
class KeptStep:
    """A model step of the journal a resumed attempt keeps: back into the transcript."""

    step: ModelResponded


@dataclass(frozen=True, slots=True)
class CallToSettle:
    """`calls[0]` of a reply (the calls after it in the same reply follow it; a pause records
    them as blocked). `kept`: a call of a step kept from the journal; `last`: of its last step."""

    calls: tuple[ToolCall, ...]
    iteration: int
    model: str
    kept: bool = False
    last: bool = True


@dataclass(slots=True)
class TurnMachine:
    """One turn's state: `state` is the conversation as the turn's events fold it (ahead
    of the log by the step being written); the rest is the attempt in progress, which the
    log does not hold whole (the transcript keeps the providers' `native` blocks). Owned and
    advanced by `decide`, like the fold owns its records."""

    state: ConversationState
    settings: TurnSettings
    # The fallback chain's models and protocol families, `settings.model` first.
    routes: tuple[RouteInfo, ...]
    new_id: Callable[[], str]
    # The conversation's history as messages, kept by the worker across turns (see
    # `build_context`).
    rendered: list[ChatMessage] = field(default_factory=list)
    # The largest event value the log takes for this conversation (None: no limit). An event
    # over it is never asked for: the log would refuse it on every attempt.
    max_event_bytes: int | None = None
    now_ms: int = 0  # the time of the observation being decided
    # -- the attempt in progress
    route: int = 0
    iteration: int = 0
    earlier: str = ""  # the text of paused parts of the reply being assembled
    isolated: bool = False
    tools: tuple[ToolSpec, ...] = ()
    messages: list[ChatMessage] = field(default_factory=list)
    done: dict[str, DoneCall] = field(default_factory=dict)
    last_text: str | None = None
    # Why the turn's cost became unknown, said when it did (a takeover reads the journal).
    unknown_cost: str | None = None
    resume: Resume | None = None
    queue: deque[KeptStep | CallToSettle] = field(default_factory=deque)
    # The call whose tool (or reconciler) runs, and the command that runs it.
    settling: CallToSettle | None = None
    running: RunTool | None = None
    # Approvals already used: one approval lets exactly one call run (over the turn).
    grants_used: set[str] = field(default_factory=set)

    @property
    def turn(self) -> ActiveTurn:
        assert self.state.active is not None, "the machine always holds an active turn"
        return self.state.active

    @property
    def model(self) -> str:
        return self.routes[self.route].model


def machine_for(
    state: ConversationState,
    settings: TurnSettings,
    primary_family: ProtocolFamily,
    new_id: Callable[[], str],
    rendered: list[ChatMessage] | None = None,
    max_event_bytes: int | None = None,
) -> TurnMachine:
    """A machine for the turn of `state` (claimed next, or active and taken over)."""
    fallbacks = (RouteInfo(r.model, r.provider.family) for r in settings.fallbacks)
    routes = (RouteInfo(settings.model, primary_family), *fallbacks)
    return TurnMachine(state, settings, routes, new_id, rendered if rendered is not None else [], max_event_bytes)


class EventTooLarge(Exception):
    """An event the machine was about to ask for is over the log's limit (not folded)."""

    def __init__(self, event: Event, size: int, limit: int) -> None:
        super().__init__(f"{event.type} of {size:,} bytes is over the log's limit of {limit:,}")
        self.event, self.size, self.limit = event, size, limit


class _Out:
    """The commands of one step: appends (measured, then folded as they are made), then one effect."""

    def __init__(self, machine: TurnMachine) -> None:
        self.machine = machine
        self.commands: list[Command] = []

    def emit(self, event: Event, wait: bool = True) -> None:
        value, limit = encode(event), self.machine.max_event_bytes
        if limit is not None and len(value) > limit:
            raise EventTooLarge(event, len(value), limit)
        rejection = apply_event(self.machine.state, event)
        if rejection is not None:
            raise RuntimeError(f"refusing to write {event.type}: the fold rejects it ({rejection.reason})")
        self.commands.append(Append(event, wait, value))

    def then(self, command: Command) -> None:
        self.commands.append(command)


def decide(machine: TurnMachine, observation: Observation) -> tuple[Command, ...]:
    """The commands that follow `observation`, the machine advanced past them. The last
    command is the one effect to carry out (its result is the next observation) or
    `Finish`. An unexpected error here ends the turn failed, visibly, like one outside."""
    machine.now_ms = observation.now_ms
    out = _Out(machine)
    try:
        _dispatch(machine, observation, out)
    except EventTooLarge as exc:
        _too_large(machine, out, exc)
    except Exception as exc:  # a bug must still end the turn with a durable outcome
        if isinstance(observation, Crashed):
            raise
        _crashed(machine, out, f"{type(exc).__name__}: {exc}")
    return tuple(out.commands)


def _dispatch(m: TurnMachine, seen: Observation, out: _Out) -> None:
    match seen:
        case Claimed():
            claim = claim_event(m.state, seen.plan, event_id=m.new_id(), run_id=m.new_id(), now_ms=m.now_ms)
            # Sent with AttemptStarted, which follows at once: one round trip for both.
            out.emit(claim, wait=False)
            _start_attempt(m, out, first=True)
        case TakenOver():
            _take_over(m, out)
        case ModelAnswered():
            _answered(m, out, seen.reply)
        case ModelFailed():
            _model_failed(m, out, seen.error)
        case ModelCutOff():
            _pause(m, out, "deadline", deadline_reached(m.settings.budget.deadline_ms, "during a model request"))
        case ToolReturned() | ToolRaised() | ToolTimedOut():
            _tool_finished(m, out, seen)
        case ToolNotStarted():
            _not_started(m, out)
        case Reconciled():
            _reconciled(m, out, seen.result)
        case Woke():
            _start_attempt(m, out, first=False)
        case Interrupted():
            _interrupted(m, out, seen.message)
        case Crashed():
            _crashed(m, out, seen.error)


# -- attempts ------------------------------------------------------------------------
def _start_attempt(m: TurnMachine, out: _Out, first: bool, resume: Resume | None = None) -> None:
    turn = m.turn
    run_id = turn.run_id if first else m.new_id()
    attempt = turn.attempt if first else turn.attempt + 1
    m.route, m.done, m.last_text, m.resume = 0, {}, None, resume
    out.emit(
        AttemptStarted(
            event_id=m.new_id(),
            conversation_id=m.state.conversation_id,
            occurred_at=m.now_ms,
            turn_id=turn.turn_id,
            run_id=run_id,
            attempt=attempt,
            model=m.routes[0].model,
            resumes_run_id=turn.run_id if resume is not None else None,
        )
    )
    turn = m.turn
    m.isolated = isolated_turn(turn.inputs)
    m.tools = m.settings.tools.specs(m.isolated)
    m.messages = list(
        build_context(m.state.history, turn.history_boundary, turn.inputs, m.settings.system_prompt, m.rendered)
    )
    m.iteration, m.earlier = 0, ""
    m.queue.clear()
    if resume is not None:
        # Rebuild the transcript of the journal, settling the calls without a result.
        m.iteration = resume.iteration
        last = resume.steps[-1]
        for step in resume.steps:
            m.queue.append(KeptStep(step))
            for index in range(len(step.tool_calls)):
                m.queue.append(CallToSettle(step.tool_calls[index:], step.iteration, step.model, True, step is last))
    _proceed(m, out)


def _attempt_failed(m: TurnMachine, out: _Out, error: ProviderError, reason: str) -> None:
    turn = m.turn
    attempt, unsafe = turn.model_attempts, turn.side_effect_started
    retry = retries_after(error, attempt, m.settings.max_attempts, unsafe)
    due = m.now_ms + round(m.settings.backoff_s(attempt, error) * 1000)
    if retry and due >= _deadline(m):
        # Not slept: the next attempt would only pause on the deadline. The turn pauses now,
        # its attempt with it (the pause closes the attempt: no AttemptFailed before it).
        limit, wait = m.settings.budget.deadline_ms / 1000, (due - m.now_ms) / 1000
        _pause(m, out, "deadline", f"{reason}; the time limit ({limit:g} s) comes before the next try, in {wait:g} s")
        return
    out.emit(AttemptFailed(**_stamp(m), reason=reason, retryable=retry))
    if not retry:
        _fail(m, out, provider_failure(error, attempts=attempt, side_effect_ran=unsafe))
        return
    out.then(SleepUntil(due))


def _deadline(m: TurnMachine) -> int:
    return m.turn.claimed_at + m.settings.budget.deadline_ms


def _take_over(m: TurnMachine, out: _Out) -> None:
    turn = m.turn
    verdict = turn.verdict
    match owner_verdict(verdict):
        case "fail":
            assert verdict is not None
            _fail(m, out, failed_by_owner(verdict.reason, turn.side_effect_started))
            return
        case "retry":
            assert verdict is not None
            _retry_after_backoff(m, out, verdict.at)
            return
        case "go_on":
            pass
    step = next_step(turn.journal, lambda start: _recovery_of(m, start))
    if isinstance(step, Resume) and _secrets_left(m, step):
        # What is left to run needs secret values the log does not keep: the journal cannot
        # be continued. A new attempt from the inputs, if nothing acted yet; else it fails.
        step = StartOver()
    if turn.attempt_state != "closed":
        # Retryable says a replay from scratch may follow: never after a side effect
        # started. Continuing the journal is not a replay (see `handlers/resume.py`).
        out.emit(AttemptFailed(**_stamp(m), reason=STOPPED_MID_ATTEMPT, retryable=not turn.side_effect_started))
    # A worker that stopped (a deploy's rebalance cut a long step) used no attempt of the
    # model's (the fold counts it in `stops`, bounded by `STOPS_ALLOWED`).
    failure = takeover_failure(step, turn.side_effect_started, turn.model_attempts, turn.stops, m.settings.max_attempts)
    if failure is not None:
        _fail(m, out, failure)
    else:
        _start_attempt(m, out, first=False, resume=step if isinstance(step, Resume) else None)


def _retry_after_backoff(m: TurnMachine, out: _Out, failed_at: int) -> None:
    """The retry a dead owner was backing off for: a fresh attempt (`Woke` starts it), due
    its backoff after the failure's event time. The wait a server asked for is not on the
    log: the exponential backoff is what is honoured."""
    turn = m.turn
    attempts, stops = turn.model_attempts, turn.stops
    failure = takeover_failure(StartOver(), turn.side_effect_started, attempts, stops, m.settings.max_attempts)
    if failure is not None:
        _fail(m, out, failure)
        return
    # No later than the deadline: the attempt started then pauses on it at once.
    due = min(failed_at + round(m.settings.backoff_s(attempts) * 1000), _deadline(m))
    if due > m.now_ms:
        out.then(SleepUntil(due))
    else:
        _start_attempt(m, out, first=False)


def _recovery_of(m: TurnMachine, start: ToolCallStarted) -> Recovery:
    tool = m.settings.tools.get(start.tool, isolated=False)
    return tool.recovery if tool is not None else "none"


def _secrets_left(m: TurnMachine, step: Resume) -> bool:
    """A call of the last kept step still to run (not finished, refused or reconciled) is
    one of a tool with secret arguments: its call on the log has them redacted."""
    for call in step.steps[-1].tool_calls:
        settled = call.call_id in step.results or call.call_id in step.refused
        if settled or step.in_doubt.get(call.call_id) == "reconcile":
            continue
        tool = m.settings.tools.get(call.name, isolated=False)
        if tool is not None and tool.has_secrets:
            return True
    return False


def _crashed(m: TurnMachine, out: _Out, error: str) -> None:
    # What the step had decided before the error is kept up to its effect, which is not run.
    out.commands = [c for c in out.commands if isinstance(c, Append | Report)]
    out.then(Report(f"a turn of {m.state.conversation_id} hit an internal error: {error}"))
    if m.state.active is None:
        out.then(Finish())  # the outcome was decided; whether it reached the log, the next owner will see
        return
    if m.turn.attempt_state == "open":
        out.emit(AttemptFailed(**_stamp(m), reason=f"internal error: {error}", retryable=False))
    _fail(m, out, INTERNAL_ERROR)


def _too_large(m: TurnMachine, out: _Out, exc: EventTooLarge) -> None:
    """The step's event the log would refuse is not written: the attempt fails for good
    (the same reply would be refused again, and another costs as much), and the turn with
    it, saying why. What the step wrote before it stands."""
    out.commands = [c for c in out.commands if isinstance(c, Append | Report)]
    out.then(Report(f"a turn of {m.state.conversation_id} cannot be recorded: {exc}"))
    if m.state.active is None:
        out.then(Finish())
        return
    if m.turn.attempt_state == "open":
        out.emit(AttemptFailed(**_stamp(m), reason=str(exc), retryable=False))
    event, spent = exc.event, ""
    if isinstance(event, ModelResponded):  # not recorded, so no metric counts it
        cost = "" if event.cost_usd is None else f", ${event.cost_usd:.4f}"
        spent = f" ({event.usage.output_tokens:,} output tokens{cost})"
    match event:
        case ModelResponded():
            what = "The model's reply"
        case ToolCallFinished():
            what = "The tool's result"
        case TurnCompleted() | TurnExhausted() | TurnFailed() | TurnPaused():
            what = "The turn's outcome, which carries the model's reply again,"
        case _:
            what = f"The turn's {event.type}"
    _fail(m, out, too_large_to_record(what, event.type, exc.size, exc.limit, spent))


# -- the loop ------------------------------------------------------------------------
def _proceed(m: TurnMachine, out: _Out) -> None:
    """Settle the calls still to settle, in order, then ask the model; stops at the first
    call that needs an effect or ends the turn."""
    while m.queue:
        item = m.queue.popleft()
        if isinstance(item, KeptStep):
            if item.step.text:
                m.last_text = item.step.text
            m.messages.append(ChatMessage("assistant", item.step.text or "", item.step.tool_calls))
            continue
        result = _settle(m, out, item)
        if result is None:
            return
        _tool_message(m, item, *result)
    _next_request(m, out)


def _tool_message(m: TurnMachine, item: CallToSettle, text: str, ok: bool) -> None:
    m.messages.append(ChatMessage("tool", text, tool_call_id=item.calls[0].call_id, is_error=not ok))


def _spent(m: TurnMachine, iterations: int) -> Spent:
    turn = m.turn
    elapsed_ms = max(0, m.now_ms - turn.claimed_at)
    if turn.cost_usd is not None:
        return Spent(iterations, turn.tool_calls, turn.cost_usd, elapsed_ms)
    return Spent(iterations, turn.tool_calls, None, elapsed_ms, m.unknown_cost or _unknown_cost(turn.journal))


def _unknown_cost(journal: list[Event]) -> str | None:
    """Why the cost of a turn taken over is unknown, as far as its journal tells: which step's
    (not always the model asked next: a fallback follows an unpriced model's billed but
    unusable reply), not whether its price or its usage was missing."""
    for e in journal:
        if isinstance(e, ModelResponded | ProtocolFailure) and e.cost_usd is None and e.usage is not None:
            return f"the cost of a reply of model {e.model!r} is unknown (no price for it, or no usage reported)"
    return None


def _cost_of(m: TurnMachine, usage: Usage, reported: bool = True) -> float | None:
    """A response's cost at the price of the model asked (the one its allowance was cut at);
    when unknown, the machine notes why, for the pause that follows."""
    cost = cost_usd(m.settings.prices, m.model, usage) if reported else None
    if cost is None and m.unknown_cost is None:
        no_price = f"the price of model {m.model!r} is unknown"
        m.unknown_cost = no_price if reported else f"a reply of model {m.model!r} reported no usage"
    return cost


def _next_request(m: TurnMachine, out: _Out) -> None:
    limit = spending_limit(_spent(m, m.iteration), m.settings.budget, m.model)
    if limit is not None:
        _pause(m, out, limit.dimension, limit.reason)
        return
    m.iteration += 1
    dimension = soft_dimension(_spent(m, m.iteration - 1), m.settings.budget)
    if dimension is not None:
        compacted, call_ids = compact_tool_exchanges(m.messages)
        if call_ids:
            out.emit(
                ContextCompacted(**_stamp(m), iteration=m.iteration, compacted_call_ids=call_ids, dimension=dimension)
            )
            m.messages = list(compacted)
    _request(m, out)


def _request(m: TurnMachine, out: _Out) -> None:
    """A request to the current link of the chain, with an output allowance whose worst
    case fits the cost left; a pause when even a short reply does not fit."""
    settings, budget = m.settings, m.settings.budget
    model = m.model
    spent = _spent(m, m.iteration)
    messages = tuple(m.messages)
    bound = input_token_bound(messages, m.tools)
    allowance = output_allowance(spent, budget, model, settings.prices.get(model), bound, settings.max_output_tokens)
    if not isinstance(allowance, int):
        _pause(m, out, allowance.dimension, allowance.reason)
        return
    request = ModelRequest(model, messages, m.tools, allowance, time_left_s(spent, budget))
    out.then(CallModel(m.route, request, m.iteration))


def _model_failed(m: TurnMachine, out: _Out, error: ProviderError) -> None:
    """Down the fallback chain while the next model speaks the same protocol; otherwise
    the attempt fails."""
    model = m.model
    if error.kind == "malformed_response":
        usage = error.usage
        out.emit(
            ProtocolFailure(
                **_stamp(m),
                iteration=m.iteration,
                model=model,
                kind="malformed_response",
                detail=error.message,
                usage=usage,
                cost_usd=None if usage is None else _cost_of(m, usage),
            )
        )
    decision = next_route(m.routes, m.route, error.kind)
    if not isinstance(decision, FallTo):
        _attempt_failed(m, out, error, f"{error}; {decision.reason}")
        return
    to_model = m.routes[decision.index].model
    out.emit(FallbackEngaged(**_stamp(m), from_model=model, to_model=to_model, reason=decision.reason))
    m.route = decision.index
    _request(m, out)


def _answered(m: TurnMachine, out: _Out, reply: ModelReply) -> None:
    settings, iteration = m.settings, m.iteration
    reply = _unique_call_ids(m.turn, reply)
    step = after_reply(reply, m.earlier)
    out.emit(
        ModelResponded(
            **_stamp(m),
            iteration=iteration,
            model=reply.model,
            text=reply.text,
            # Secret tool arguments are redacted on the log; the tools get the values.
            tool_calls=tuple(map(settings.tools.recorded, reply.tool_calls)),
            usage=reply.usage,
            cost_usd=_cost_of(m, reply.usage, reply.usage_reported),
            finish_reason=reply.finish_reason,
        ),
        # A reply that ends the turn is followed at once by the outcome: one round trip for
        # both (a cut-off one with tool calls too: on the log alone, a takeover would run them).
        # Tools to run wait (a tool may act), and so does a paused reply (another request follows).
        wait=isinstance(step, RunTools | AskAgain) and iteration < settings.budget.max_iterations,
    )
    if reply.text:
        m.last_text = reply.text
    if isinstance(step, Complete):
        _end(m, out, outcomes.completed(m.turn, _next_stamp(m), step.reply, m.model))
    elif isinstance(step, Refused):
        _end(m, out, outcomes.failed(m.turn, _next_stamp(m), step.error, m.model, step.reason, step.text))
    elif isinstance(step, CutOff):
        _end(m, out, outcomes.exhausted(m.turn, _next_stamp(m), step.text, m.model, "output_tokens"))
    elif iteration >= settings.budget.max_iterations:
        # No iteration is left to read the results: the tools do not run.
        _end(m, out, outcomes.exhausted(m.turn, _next_stamp(m), m.last_text, m.model))
    else:
        m.messages.append(ChatMessage("assistant", reply.text or "", reply.tool_calls, native=reply.native))
        if isinstance(step, AskAgain):
            m.earlier += reply.text or ""
        for index in range(len(reply.tool_calls)):
            m.queue.append(CallToSettle(reply.tool_calls[index:], iteration, reply.model))
        _proceed(m, out)


def _unique_call_ids(turn: ActiveTurn, reply: ModelReply) -> ModelReply:
    """A call id is a call's name on the log for the whole turn (its start, result or refusal,
    and a takeover's journal, are keyed by it). Some servers give the same one again (an
    OpenAI-compatible server's `call_0` at every step, or twice in a reply): such a call is
    renamed `<id>-2`, `-3`, ... (within an id's 256 characters), on the log and in the
    transcript sent back alike -- the provider's own blocks (`native`) included."""
    taken = set(turn.operations)
    taken.update(c.call_id for e in turn.journal if isinstance(e, ModelResponded) for c in e.tool_calls)
    calls = []
    for call in reply.tool_calls:
        given, n = call.call_id, 1
        while given in taken:
            n += 1
            suffix = f"-{n}"
            given = call.call_id[: MAX_ID_CHARS - len(suffix)] + suffix
        taken.add(given)
        calls.append(call if given == call.call_id else call.model_copy(update={"call_id": given}))
    if calls == list(reply.tool_calls):
        return reply
    return dataclasses.replace(reply, tool_calls=tuple(calls), native=_renamed_blocks(reply, calls))


def _renamed_blocks(reply: ModelReply, calls: list[ToolCall]) -> tuple[Mapping[str, Any], ...] | None:
    """The provider's blocks with each tool-use block's id as its call is now named (the calls
    are in the blocks' order: they were read from them)."""
    if reply.native is None:
        return None
    ids = iter(c.call_id for c in calls)
    out: list[Mapping[str, Any]] = []
    for block in reply.native:
        if block.get("type") == "tool_use":
            block = {**block, "id": next(ids, block.get("id"))}
        out.append(block)
    return tuple(out)


# -- tool calls ----------------------------------------------------------------------
def _settle(m: TurnMachine, out: _Out, item: CallToSettle) -> tuple[str, bool] | None:
    """The result the model reads for `item`, or None when an effect settles it (or it
    ended the turn)."""
    if not item.kept:
        return _handle_call(m, out, item)
    assert m.resume is not None
    call = item.calls[0]
    finished = m.resume.results.get(call.call_id)
    if finished is not None:
        m.done[call.call_id] = DoneCall(call.name, call.arguments, finished.ok, finished.result)
        return finished.result, finished.ok
    refused = m.resume.refused.get(call.call_id)
    if refused is not None:
        seen = m.turn.invalid_calls.get(refused.signature or "", 1)
        return tool_error(refused.detail, seen, m.settings.repeats), False
    how = m.resume.in_doubt.get(call.call_id)
    if how == "reconcile":
        m.settling = item
        out.then(Reconcile(call, _timeout_s(m, call.name)))
        return None
    if how is not None or item.last:
        return _handle_call(m, out, item)
    return DID_NOT_RUN, False


def _handle_call(m: TurnMachine, out: _Out, item: CallToSettle) -> tuple[str, bool] | None:
    checked = validate_call(m.settings.tools, item.calls[0], m.isolated)
    if isinstance(checked, InvalidCall):
        return _invalid_call(m, out, checked, item)
    limit = hard_limit(_spent(m, item.iteration), m.settings.budget, m.model)
    if limit is not None:
        _pause(m, out, limit.dimension, limit.reason, item.calls)
        return None
    if checked.tool.needs_approval:
        decision = approval_of(m.turn.inputs, checked.signature, m.grants_used)
        if decision is None:
            _pause_for_approval(m, out, checked.call, item.calls[1:])
            return None
        approved, grant = decision
        if not approved:
            return DENIED, False
        m.grants_used.add(grant)
    _run_tool(m, out, checked, item)
    return None


def _invalid_call(m: TurnMachine, out: _Out, invalid: InvalidCall, item: CallToSettle) -> tuple[str, bool] | None:
    call, policy = invalid.call, m.settings.repeats

    def failure(kind: ProtocolFailureKind, detail: str) -> ProtocolFailure:
        return ProtocolFailure(
            **_stamp(m),
            iteration=item.iteration,
            model=item.model,
            call_id=call.call_id,
            signature=invalid.signature,
            kind=kind,
            detail=detail,
        )

    out.emit(failure(invalid.kind, invalid.detail))
    seen = m.turn.invalid_calls.get(invalid.signature, 0)
    action = policy.action(seen)
    if action != "report":
        what = "the turn was stopped" if action == "stop" else "a strategy-change instruction was sent"
        detail = f"the same invalid call to {call.name!r} was made {seen} times; {what}"
        out.emit(failure("repeated_call", detail))
        if action == "stop":
            _fail(m, out, repeated_call_error(call.name, call.arguments, seen))
            return None
    return tool_error(invalid.detail, seen, policy), False


def _timeout_s(m: TurnMachine, tool_name: str) -> float:
    """How long a call of the tool (or its reconciler) may run: its own, or the worker's."""
    tool = m.settings.tools.get(tool_name, isolated=False)
    return (tool.timeout_s if tool is not None else None) or m.settings.tool_timeout_s


def _run_tool(m: TurnMachine, out: _Out, checked: ValidCall, item: CallToSettle) -> None:
    call, tool = checked.call, checked.tool
    key = None
    if tool.idempotent:
        key = key_of_first_run(m.turn.journal, call.call_id) or idempotency_key(
            m.state.conversation_id, m.turn.turn_id, call.call_id
        )
    # A side-effecting call runs to its own timeout even past the deadline: cut off, it would
    # be in doubt for good (cancelling cannot stop a thread, and a resume's model may make the
    # call again, under a new key); its result recorded, the turn then pauses on its deadline.
    own_s = _timeout_s(m, tool.name)
    left_s = time_left_s(_spent(m, item.iteration), m.settings.budget)
    timeout_s = own_s if tool.side_effect else min(own_s, left_s)
    # On the log, acknowledged, before the tool can touch anything.
    started = ToolCallStarted(
        **_stamp(m),
        iteration=item.iteration,
        call_id=call.call_id,
        tool=tool.name,
        arguments=call.arguments,
        side_effect=tool.side_effect,
        idempotency_key=key,
    )
    out.emit(started)
    m.settling = item
    m.running = RunTool(started, checked.arguments, timeout_s, at_deadline=not tool.side_effect and timeout_s == left_s)
    out.then(m.running)


def _tool_finished(m: TurnMachine, out: _Out, seen: ToolReturned | ToolRaised | ToolTimedOut) -> None:
    item, running = m.settling, m.running
    assert item is not None and running is not None, "a tool result without a tool running"
    m.settling = m.running = None
    call = item.calls[0]
    if isinstance(seen, ToolTimedOut) and running.at_deadline:
        _cancelled_at_deadline(m, out, item, running.started)
        return
    text, ok = tool_outcome(seen, running.timeout_s)
    text = _finish_call(m, out, call, item.iteration, ok, text)
    _tool_message(m, item, text, ok)
    _proceed(m, out)


def _finish_call(
    m: TurnMachine, out: _Out, call: ToolCall, iteration: int, ok: bool, result: str, reconciled: bool = False
) -> str:
    """Records the call's result (bounded to fit a log value) and returns it."""
    finished = ToolCallFinished(
        **_stamp(m),
        iteration=iteration,
        call_id=call.call_id,
        ok=ok,
        result=bounded_result(result),
        reconciled=reconciled,
    )
    try:
        out.emit(finished)
    except EventTooLarge as exc:
        cut = result_cut_to_fit(finished, result, exc.limit)
        if cut is None:
            raise
        out.emit(cut)
        finished = cut
    result = finished.result
    # As the log keeps the call (secrets redacted): a pause's kept text quotes it.
    m.done[call.call_id] = DoneCall(call.name, m.settings.tools.recorded(call).arguments, ok, result)
    return result


def _reconciled(m: TurnMachine, out: _Out, result: str | NotRun | None) -> None:
    item = m.settling
    assert item is not None, "a reconciler's answer without a call in doubt"
    m.settling = None
    call = item.calls[0]
    if result is None:
        _fail(m, out, reconcile_unknown(call.name, call.call_id))
        return
    ok, said = (False, RECONCILED_NOT_RUN) if isinstance(result, NotRun) else (True, result)
    text = _finish_call(m, out, call, item.iteration, ok, said, reconciled=True)
    _tool_message(m, item, text, ok)
    _proceed(m, out)


def _not_started(m: TurnMachine, out: _Out) -> None:
    """The run was stopped (revoke, drain) while its ToolCallStarted was being
    acknowledged: the body never began. Say so on the log, best effort (not waited for:
    a superseded run's write is refused by every reader anyway), so the next owner reads a
    failed call that did not run instead of an unknown one. A read-only call is left in
    doubt: the next owner just runs it (an error recorded here would be its result). So is
    a call an earlier run of the turn started (this run was running it again): that one may
    have acted, and "it had no effect" would tell the model to make it anew."""
    started = m.running.started if m.running is not None else None
    m.settling = m.running = None
    active = m.state.active
    if (
        started is not None
        and started.side_effect
        and active is not None
        and started.call_id in active.operations
        and not started_before(active.journal, started)
    ):
        finished = ToolCallFinished(
            **_stamp(m), iteration=started.iteration, call_id=started.call_id, ok=False, result=NOT_STARTED
        )
        out.emit(finished, wait=False)
    out.then(Finish())


def _cancelled_at_deadline(m: TurnMachine, out: _Out, item: CallToSettle, started: ToolCallStarted) -> None:
    """A read-only call the deadline cut off (a side-effecting one is not cut: `_run_tool`)."""
    failure = CANCELLED_AT_DEADLINE
    out.emit(ToolCallFinished(**_stamp(m), iteration=item.iteration, call_id=started.call_id, ok=False, result=failure))
    m.done[started.call_id] = DoneCall(started.tool, started.arguments, False, failure)
    why = deadline_reached(m.settings.budget.deadline_ms, f"while {started.tool} ran")
    _pause(m, out, "deadline", why, item.calls[1:])


# -- interrupt-and-merge -------------------------------------------------------------
def interruptible(m: TurnMachine) -> bool:
    """Whether a message arriving now may withdraw the turn (the `interrupt` double-text
    policy): its attempt is running and no side-effecting call has started -- judged on the
    machine's own state, which is ahead of the log by the step being written, so a
    `ToolCallStarted` decided but not yet acknowledged already rules it out."""
    turn = m.state.active
    return turn is not None and turn.attempt_state == "open" and not turn.side_effect_started


def _interrupted(m: TurnMachine, out: _Out, message: MessageReceived) -> None:
    if not interruptible(m):
        raise ValueError("an interruption of a turn that cannot be interrupted")
    m.settling = m.running = None
    m.queue.clear()
    # The message is on the log before anything this run writes next: fold it as every
    # reader will (the machine's state stays the log's), then withdraw the turn for it.
    apply_event(m.state, message)
    out.emit(TurnInterrupted(**_stamp(m), message_id=message.message_id))
    out.then(Finish())


# -- outcomes ------------------------------------------------------------------------
def _pause(m: TurnMachine, out: _Out, reason: PauseReason, why: str, blocked: tuple[ToolCall, ...] = ()) -> None:
    blocked = _recorded(m, blocked)
    hint = resume_hint(m.state.conversation_id, m.turn.turn_id, why)
    stamp = _next_stamp(m)

    def pause(kept: str, calls: tuple[ToolCall, ...]) -> Event:
        return outcomes.paused(m.turn, stamp, reason, kept, hint, m.model, blocked_calls=calls)

    _end(m, out, _recordable(m, pause, kept_work(m.last_text, m.done.values(), blocked), blocked))


def _pause_for_approval(m: TurnMachine, out: _Out, call: ToolCall, blocked: tuple[ToolCall, ...]) -> None:
    blocked = _recorded(m, blocked)
    turn, stamp = m.turn, _next_stamp(m)
    hint = approval_hint(m.state.conversation_id, turn.turn_id, call)

    def pause(kept: str, calls: tuple[ToolCall, ...]) -> Event:
        kept = f"{kept}\n{waiting_for_approval(call)}".strip()
        return outcomes.paused(turn, stamp, "approval", kept, hint, m.model, call, calls)

    _end(m, out, _recordable(m, pause, kept_work(m.last_text, m.done.values(), blocked), blocked))


def _recordable(
    m: TurnMachine, pause: Callable[[str, tuple[ToolCall, ...]], Event], kept: str, blocked: tuple[ToolCall, ...]
) -> Event:
    """The pause, or, when its work listed in full would pass the log's limit (thousands of
    calls in one reply), the pause with that work in brief: still a pause to resume, not a
    failure after its side effects ran."""
    whole = pause(kept, blocked)
    limit = m.max_event_bytes
    if limit is None or len(encode(whole)) <= limit:
        return whole
    return pause(kept_in_brief(m.last_text, len(m.done), len(blocked)), ())


def _recorded(m: TurnMachine, calls: tuple[ToolCall, ...]) -> tuple[ToolCall, ...]:
    """Calls as the log keeps them: their tools' secret arguments redacted."""
    return tuple(m.settings.tools.recorded(c) for c in calls)


def _fail(m: TurnMachine, out: _Out, error: str) -> None:
    _end(m, out, outcomes.failed(m.turn, _next_stamp(m), error, m.model))


def _end(m: TurnMachine, out: _Out, outcome: Event) -> None:
    out.emit(outcome)
    out.then(Finish())


def _next_stamp(m: TurnMachine) -> outcomes.Stamp:
    return outcomes.Stamp(m.new_id(), m.state.conversation_id, m.now_ms)


def _stamp(m: TurnMachine) -> dict[str, str | int]:
    return _next_stamp(m).of(m.turn)
