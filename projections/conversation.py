"""The conversation fold: `apply_event(state, event)` advances one conversation by one event.

The log is the arbiter. Every reader (the worker that wrote the events, the worker that
takes the partition over after a crash, an auditor) folds the same events to the same
state, so a conflicting event is resolved the same way everywhere: the first valid claim
wins, and events of a run that is no longer the active one are ignored. The fold returns
why it ignored an event, so the worker can dead-letter bad input and the auditor can
report it; it never raises on an event that decoded.
"""

from __future__ import annotations

from dataclasses import dataclass

from turnstile.events import (
    EXHAUSTED_BECAUSE,
    STOPPED_MID_ATTEMPT,
    AttemptFailed,
    AttemptStarted,
    ContextCompacted,
    Event,
    FallbackEngaged,
    InputInjected,
    MessageReceived,
    MessageRejected,
    ModelResponded,
    ProtocolFailure,
    ResumeRequested,
    TerminalOutcome,
    ToolCallFinished,
    ToolCallStarted,
    TurnClaimed,
    TurnCompleted,
    TurnEnvelope,
    TurnExhausted,
    TurnFailed,
    TurnInterrupted,
    TurnPaused,
    Usage,
    content_fingerprint,
    names_its_inputs,
)
from turnstile.projections.state import (
    ActiveTurn,
    ApprovalGrant,
    AttemptVerdict,
    ConversationState,
    HistoryEntry,
    InputKind,
    Operation,
    OutcomeKind,
    PendingInput,
    TurnRecord,
)


@dataclass(frozen=True, slots=True)
class Rejection:
    """Why the fold left its state untouched. `conflict` marks input that contradicts what
    was accepted (same id, other content): a producer bug to dead-letter. Other rejections
    are duplicates or stale events that every reader ignores the same way."""

    reason: str
    conflict: bool = False


def new_state(conversation_id: str) -> ConversationState:
    return ConversationState(conversation_id=conversation_id)


def apply_event(state: ConversationState, event: Event) -> Rejection | None:
    """Fold one event into `state` in place. Returns None when accepted."""
    if event.conversation_id != state.conversation_id:
        return Rejection(f"event of conversation {event.conversation_id!r} folded into {state.conversation_id!r}")
    rejection = _dispatch(state, event)
    if rejection is None:
        state.events_applied += 1
    return rejection


def _dispatch(state: ConversationState, event: Event) -> Rejection | None:
    match event:
        case MessageReceived():
            return _add_input(state, event.message_id, "message", event.content, event.occurred_at)
        case InputInjected():
            pending = PendingInput(
                event.occurrence_key, "injected", event.content, event.occurred_at, event.source, _grant(state, event)
            )
            return _add_pending(state, pending)
        case ResumeRequested():
            return _add_input(state, event.request_id, "resume", event.content, event.occurred_at)
        case MessageRejected():
            return _reject_message(state, event)
        case TurnClaimed():
            return _claim(state, event)
        case AttemptStarted():
            return _start_attempt(state, event)
        case TurnCompleted() | TurnFailed() | TurnPaused() | TurnExhausted():
            return _finish(state, event)
        case TurnInterrupted():
            return _interrupt(state, event)
        case _:
            return _record_step(state, event)


def _add_input(state: ConversationState, input_id: str, kind: InputKind, content: str, at: int) -> Rejection | None:
    return _add_pending(state, PendingInput(input_id, kind, content, at))


def _add_pending(state: ConversationState, item: PendingInput) -> Rejection | None:
    fingerprint = content_fingerprint(item.content)
    seen = state.seen_inputs.get(item.input_id)
    if seen is not None:
        if seen == fingerprint:
            return Rejection(f"duplicate of input {item.input_id!r}")
        return Rejection(f"input id {item.input_id!r} reused with different content", conflict=True)
    state.seen_inputs[item.input_id] = fingerprint
    state.pending[item.input_id] = item
    return None


def _reject_message(state: ConversationState, event: MessageRejected) -> Rejection | None:
    """A refused message leaves the pending set for good; republishing it stays a duplicate."""
    item = state.pending.get(event.message_id)
    kind = "resume" if event.reason == "resume_invalid" else "message"
    if item is None or item.kind != kind:
        return Rejection(f"rejection of {event.message_id!r}, which is not a pending {kind}")
    del state.pending[event.message_id]
    state.rejected[event.message_id] = event.reason
    return None


def _grant(state: ConversationState, event: InputInjected) -> ApprovalGrant | None:
    """An approval decides the call its turn paused on; one naming another call (or a turn
    that did not pause for approval) stays a plain input the model reads."""
    decision = event.approval
    if decision is None:
        return None
    record = state.turns.get(decision.turn_id)
    call = record.pending_call if record is not None else None
    if call is None or call.call_id != decision.call_id:
        return None
    return ApprovalGrant(decision.turn_id, call.call_id, call.name, call.arguments, decision.approved)


def _claim(state: ConversationState, claim: TurnClaimed) -> Rejection | None:
    if state.active is not None:
        return Rejection(f"claim while turn {state.active.turn_id} is active")
    missing = [i for i in claim.input_ids if i not in state.pending]
    if missing:
        return Rejection(f"claimed inputs not pending: {missing[:5]}")
    if len(set(claim.input_ids)) != len(claim.input_ids):
        return Rejection("a claim names an input more than once")
    if not names_its_inputs(claim.turn_id, claim.input_ids):
        return Rejection("turn id is not the logical id of the claimed inputs")
    if claim.history_boundary != len(state.history):
        return Rejection(f"history boundary {claim.history_boundary} != history length {len(state.history)}")
    if claim.attempt != 1:
        return Rejection("a claim opens attempt 1; retries are AttemptStarted")
    inputs = tuple(state.pending.pop(i) for i in claim.input_ids)
    for i in claim.input_ids:
        state.claimed_by[i] = claim.turn_id
    state.active = ActiveTurn(
        turn_id=claim.turn_id,
        inputs=inputs,
        history_boundary=claim.history_boundary,
        claimed_at=claim.occurred_at,
        run_id=claim.run_id,
        attempt=1,
    )
    return None


def _start_attempt(state: ConversationState, start: AttemptStarted) -> Rejection | None:
    turn = state.active
    if turn is None or turn.turn_id != start.turn_id:
        return Rejection("attempt of a turn that is not active")
    first = turn.attempt_state == "claimed" and start.attempt == turn.attempt and start.run_id == turn.run_id
    retry = turn.attempt_state == "closed" and start.attempt == turn.attempt + 1
    if not (first or retry):
        return Rejection(f"attempt {start.attempt} does not follow attempt {turn.attempt}")
    resumes = start.resumes_run_id
    if resumes is not None and not (retry and resumes == turn.run_id):
        return Rejection(f"attempt {start.attempt} resumes run {resumes}, which is not the run it follows")
    if retry and resumes is None and turn.side_effect_started:
        return Rejection("no automatic attempt after a side effect started")
    turn.run_id, turn.attempt, turn.attempt_state, turn.verdict = start.run_id, start.attempt, "open", None
    turn.model = start.model
    if resumes is None:
        turn.iterations = 0
        turn.journal = []
    return None


def _active_run(state: ConversationState, event: TurnEnvelope) -> ActiveTurn | Rejection:
    turn = state.active
    if turn is None or turn.turn_id != event.turn_id:
        return Rejection("event of a turn that is not active")
    # A claimed attempt that never started can still be declared failed (its owner died).
    allowed = ("claimed", "open") if isinstance(event, AttemptFailed) else ("open",)
    if turn.run_id != event.run_id or turn.attempt_state not in allowed:
        return Rejection(f"event of run {event.run_id}, which is not the open attempt")
    return turn


def _record_step(state: ConversationState, event: Event) -> Rejection | None:
    assert isinstance(event, TurnEnvelope)  # inputs, claims and outcomes are dispatched before
    turn = _active_run(state, event)
    if isinstance(turn, Rejection):
        return turn
    if event.event_id in turn.step_ids:
        return Rejection(f"duplicate of event {event.event_id!r}")
    match event:
        case ModelResponded():
            if event.iteration <= turn.iterations:
                return Rejection(f"iteration {event.iteration} is already on the journal of this attempt")
            turn.iterations = event.iteration
            turn.model = event.model
            _spend(turn, event.usage, event.cost_usd)
        case ToolCallStarted():
            op = turn.operations.get(event.call_id)
            if op is not None and (op.status != "started" or (op.side_effect and event.idempotency_key is None)):
                return Rejection(f"tool call {event.call_id} started again")
            turn.tool_calls += 1
            turn.operations[event.call_id] = Operation(event.call_id, event.tool, event.side_effect, "started")
        case ToolCallFinished():
            op = turn.operations.get(event.call_id)
            if op is None:
                return Rejection(f"finish of tool call {event.call_id} that never started")
            op.status = "succeeded" if event.ok else "failed"
        case FallbackEngaged():
            turn.fallbacks += 1
            turn.model = event.to_model
        case AttemptFailed():
            turn.attempt_state = "closed"
            turn.verdict = AttemptVerdict(event.retryable, event.reason, event.occurred_at)
            if event.reason == STOPPED_MID_ATTEMPT:
                turn.stops += 1
        case ProtocolFailure():
            # Repeats of one invalid call are counted per logical turn; the `repeated_call`
            # records that report the count are not themselves counted.
            if event.signature is not None and event.kind != "repeated_call":
                turn.invalid_calls[event.signature] = turn.invalid_calls.get(event.signature, 0) + 1
            if event.usage is not None:  # an unusable reply, billed all the same
                _spend(turn, event.usage, event.cost_usd)
        case ContextCompacted():
            pass  # recorded on the log for audit; it changes no state the engine decides on
    turn.step_ids.add(event.event_id)
    if isinstance(event, ModelResponded | ToolCallStarted | ToolCallFinished | ProtocolFailure):
        turn.journal.append(event)
    return None


def _spend(turn: ActiveTurn, usage: Usage, cost_usd: float | None) -> None:
    turn.input_tokens += usage.input_tokens
    turn.output_tokens += usage.output_tokens
    turn.cached_input_tokens += usage.cached_input_tokens
    turn.cache_write_tokens += usage.cache_write_tokens
    turn.reasoning_tokens += usage.reasoning_tokens
    # An unknown price poisons the total: a budget must not read it as zero.
    turn.cost_usd = None if turn.cost_usd is None or cost_usd is None else turn.cost_usd + cost_usd


def _interrupt(state: ConversationState, event: TurnInterrupted) -> Rejection | None:
    """The `interrupt` double-text policy withdrew the open turn: its inputs return to the
    pending set (the claim is released: rule 1 counts claims that stand) and nothing goes to
    history, so the next claim takes them with the message that interrupted, in order.
    Refused once a side-effecting call started: that turn runs on, as under `enqueue`."""
    turn = _active_run(state, event)
    if isinstance(turn, Rejection):
        return turn
    if turn.side_effect_started:
        return Rejection("a turn whose side-effecting tool started is not interrupted")
    item = state.pending.get(event.message_id)
    if item is None or item.kind != "message":
        return Rejection(f"interrupted by {event.message_id!r}, which is not a pending message")
    released = {i.input_id: i for i in turn.inputs}
    state.pending = {**released, **state.pending}
    for input_id in released:
        state.claimed_by.pop(input_id, None)
    state.active = None
    return None


def closed_run_cannot_end_so(turn: ActiveTurn, outcome: TerminalOutcome) -> bool:
    """A run closed by `AttemptFailed` may still end the turn as failed (that is how a
    takeover, or the run itself, reports a failure it cannot retry), but not as completed,
    paused or exhausted: such an outcome comes from a worker that was declared dead and
    kept going, and its turn is being retried or failed by the owner that closed it."""
    return turn.attempt_state == "closed" and not isinstance(outcome, TurnFailed)


_OUTCOME_KIND: dict[type, OutcomeKind] = {
    TurnCompleted: "completed",
    TurnFailed: "failed",
    TurnPaused: "paused",
    TurnExhausted: "exhausted",
}


def _finish(state: ConversationState, outcome: TerminalOutcome) -> Rejection | None:
    turn = state.active
    if turn is None or turn.turn_id != outcome.turn_id:
        return Rejection("outcome of a turn that is not active")
    if turn.run_id != outcome.run_id:
        return Rejection(f"outcome from run {outcome.run_id}, which is not the active run")
    if closed_run_cannot_end_so(turn, outcome):
        return Rejection(f"{outcome.type} from run {outcome.run_id}, which an AttemptFailed already closed")
    kind = _OUTCOME_KIND[type(outcome)]
    refused = isinstance(outcome, TurnFailed) and outcome.reason == "refusal"
    for item in turn.inputs:
        state.history.append(HistoryEntry("user", item.content, item.occurred_at, turn.turn_id, withheld=refused))
    closing = _closing_text(outcome, turn.journal)
    state.history.append(HistoryEntry("assistant", closing, outcome.occurred_at, turn.turn_id, kind))
    pending_call = outcome.pending_call if isinstance(outcome, TurnPaused) else None
    state.turns[turn.turn_id] = TurnRecord(turn.turn_id, turn.input_ids, kind, turn.attempt, pending_call)
    state.active = None
    return None


# How the note closing a failed turn begins (its error follows): later turns read it.
FAILED_NOTE = "[This turn failed: "


def _closing_text(outcome: TerminalOutcome, journal: list[Event]) -> str:
    """What later turns see of this one: the reply, or a plain note of how it ended. A turn
    that ended without its answer also names the side effects it made (or may have made):
    a later turn -- a resume, or the user's "try again" -- must not make them again unaware
    (a side effect cut off at a deadline was called again after a resume when the model read
    only "failed")."""
    match outcome:
        case TurnCompleted():
            return outcome.reply
        case TurnFailed():
            return f"{FAILED_NOTE}{outcome.error}]{_side_effects(outcome, journal)}"
        case TurnPaused():
            # Not its resume hint: that is for the people who resume it (commands, event names).
            paused = f"[Paused ({outcome.reason}) before it finished]"
            return f"{outcome.kept}\n{paused}{_side_effects(outcome, journal)}".lstrip()
        case TurnExhausted():
            stopped = f"[Stopped: {EXHAUSTED_BECAUSE[outcome.allowance]}]"
            return f"{outcome.last_text or ''}\n{stopped}{_side_effects(outcome, journal)}".lstrip()


_DID = {"succeeded": "done", "failed": "failed (no effect recorded)", "unknown": "may have acted (no result recorded)"}


def _side_effects(outcome: TurnFailed | TurnExhausted | TurnPaused, journal: list[Event]) -> str:
    """The side effects of the outcome's operations, with the arguments the journal has of
    them (the attempt that ended the turn and the runs it resumed)."""
    calls = [op for op in outcome.operations if op.side_effect]
    if not calls:
        return ""
    arguments = {e.call_id: e.arguments for e in journal if isinstance(e, ToolCallStarted)}
    lines = "\n".join(
        f"- {op.tool}({arguments.get(op.call_id, '…')}) (call {op.call_id}): {_DID[op.status]}" for op in calls
    )
    return f"\nSide effects of this turn, not to be repeated unless asked:\n{lines}"
