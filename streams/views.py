"""Read models of one conversation: its folded state and a timeline per turn, built from
the log (`build_view`) or kept beside a worker's fold (`ConversationView.add`, through
`streams.read_model`). `turnstile inspect` renders them with rich; the HTTP service returns
them as JSON (or a small HTML page), the console as its pages.

Every event is folded with the same `apply_event` the worker uses, so the view agrees with
the engine; events the fold ignores (a stale run's, a duplicate input) are kept in the
timeline, marked `ignored` with the reason, because an operator wants to see them too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, assert_never

from turnstile.events import (
    EXHAUSTED_BECAUSE,
    OUTCOME_TYPES,
    AttemptFailed,
    AttemptStarted,
    DecodeError,
    Event,
    FallbackEngaged,
    ModelResponded,
    ProtocolFailure,
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
    decode,
    decode_record,
)
from turnstile.handlers.operations import awaiting_approval
from turnstile.projections import ConversationState, apply_event, new_state
from turnstile.streams.log import Record
from turnstile.streams.timeline import describe


class TimelineEntry(NamedTuple):
    """One event of a turn. It keeps the record's bytes, not a rendering: a worker's read
    model adds an entry per folded event, and decoding and describing it again is paid by
    the page that shows it, not by the fold. A tuple of plain values, so the cyclic GC
    stops tracking it (a dataclass per folded event made the GC the fold's main cost)."""

    partition: int
    offset: int
    occurred_at: int
    type: str
    value: bytes
    ignored: str | None = None  # why the fold ignored it

    @property
    def event(self) -> Event:
        event = decode(self.value)
        assert not isinstance(event, DecodeError), "an entry is made from a decoded event"
        return event

    @property
    def text(self) -> str:
        event = self.event
        turn = getattr(event, "turn_id", "")
        return describe(event).removeprefix(f"{event.type:<17} ").removeprefix(f"turn {turn[:8]} ")


@dataclass(slots=True)
class AttemptView:
    attempt: int
    run_id: str
    model: str
    started_at: int
    iterations: int = 0
    failed: str | None = None
    retryable: bool | None = None


@dataclass(slots=True)
class ToolCallView:
    call_id: str
    tool: str
    iteration: int
    side_effect: bool
    status: str = "started"  # started | succeeded | failed


@dataclass(slots=True)
class TurnView:
    turn_id: str
    input_ids: tuple[str, ...]
    claimed_at: int
    attempts: list[AttemptView] = field(default_factory=list)
    iterations: int = 0  # model responses over every attempt
    tool_calls: list[ToolCallView] = field(default_factory=list)
    protocol_failures: int = 0
    fallbacks: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float | None = 0.0
    outcome: str | None = None  # completed | failed | paused | exhausted | interrupted; None while active
    outcome_detail: str | None = None
    ended_at: int | None = None
    duration_ms: int | None = None
    entries: list[TimelineEntry] = field(default_factory=list)
    # A worker's read model keeps the timelines of recent turns only: this one's must be
    # read from the log.
    entries_dropped: bool = False


@dataclass(slots=True)
class ConversationView:
    """`state` is the conversation's fold: the view's own (`build_view`), or a worker's,
    which `add` is then told about event by event (`streams.read_model`)."""

    state: ConversationState
    turns: dict[str, TurnView] = field(default_factory=dict)  # in claim order
    undecodable: int = 0
    last_event_at: int | None = None

    def add(self, record: Record, event: Event, ignored: str | None) -> None:
        """Note an event the state's fold has just applied (`ignored`: why it refused it)."""
        self.last_event_at = max(self.last_event_at or 0, event.occurred_at)
        _record(self, record, event, ignored)


# A turn is named by its id or by its first characters, as the pages and `inspect` show it.
MIN_TURN_PREFIX = 8


def turn_named(view: ConversationView, turn_id: str) -> str:
    """The id of the view's turn that `turn_id` names: itself, or the one turn (of the view,
    of the state, or the active one) whose id it begins when it has 8+ characters; else
    `turn_id` unchanged (no such turn, or more than one)."""
    state = view.state
    known = {*view.turns, *state.turns, *(() if state.active is None else (state.active.turn_id,))}
    if turn_id in known or len(turn_id) < MIN_TURN_PREFIX:
        return turn_id
    matches = [t for t in known if t.startswith(turn_id)]
    return matches[0] if len(matches) == 1 else turn_id


def build_view(conversation_id: str, records: list[Record], start: ConversationState | None = None) -> ConversationView:
    """Fold the records of `conversation_id` (others are skipped) in log order, into `start`
    (a snapshot's state, whose turns have no timelines: `ConversationView`) or a new state."""
    view = ConversationView(start if start is not None else new_state(conversation_id))
    for record in records:
        event = decode_record(record.key, record.value)
        if isinstance(event, DecodeError):
            view.undecodable += 1  # (a record under another key: the workers dead-letter it)
            continue
        if event.conversation_id != conversation_id:
            continue
        rejection = apply_event(view.state, event)
        view.add(record, event, None if rejection is None else rejection.reason)
    return view


def _spent(turn: TurnView, usage: Usage, cost_usd: float | None) -> None:
    turn.input_tokens += usage.input_tokens
    turn.output_tokens += usage.output_tokens
    turn.cost_usd = None if turn.cost_usd is None or cost_usd is None else turn.cost_usd + cost_usd


def _record(view: ConversationView, record: Record, event: Event, ignored: str | None) -> None:
    if not isinstance(event, TurnEnvelope):  # (not getattr: pydantic's miss raises, ~8 µs an event)
        return
    turn_id = event.turn_id
    turn = view.turns.get(turn_id)
    if turn is None:
        if not isinstance(event, TurnClaimed) or ignored is not None:
            return
        turn = view.turns[turn_id] = TurnView(turn_id, event.input_ids, event.occurred_at)
    # tuple.__new__: a NamedTuple's generated __new__ costs 3x more, once per folded event.
    fields = (record.partition, record.offset, event.occurred_at, event.type, record.value or b"", ignored)
    turn.entries.append(tuple.__new__(TimelineEntry, fields))
    if ignored is not None:
        return
    match event:
        case AttemptStarted():
            turn.attempts.append(AttemptView(event.attempt, event.run_id, event.model, event.occurred_at))
        case ModelResponded():
            turn.iterations += 1
            if turn.attempts:
                turn.attempts[-1].iterations = event.iteration
            _spent(turn, event.usage, event.cost_usd)
        case ToolCallStarted():
            turn.tool_calls.append(ToolCallView(event.call_id, event.tool, event.iteration, event.side_effect))
        case ToolCallFinished():
            for call in turn.tool_calls:
                if call.call_id == event.call_id:
                    call.status = "succeeded" if event.ok else "failed"
        case ProtocolFailure():
            turn.protocol_failures += 1
            if event.usage is not None:  # an unusable reply, billed all the same
                _spent(turn, event.usage, event.cost_usd)
        case FallbackEngaged():
            turn.fallbacks += 1
        case AttemptFailed():
            if turn.attempts:
                turn.attempts[-1].failed, turn.attempts[-1].retryable = event.reason, event.retryable
        case TurnInterrupted():  # withdrawn by the interrupt policy: its inputs went back to pending
            turn.outcome, turn.ended_at = "interrupted", event.occurred_at
            turn.duration_ms = event.occurred_at - turn.claimed_at
            turn.outcome_detail = f"interrupted by message {event.message_id}; its inputs are claimed again with it"
        case _ if isinstance(event, OUTCOME_TYPES):
            turn.outcome = event.type.removeprefix("Turn").lower()
            turn.ended_at = event.occurred_at
            turn.duration_ms = event.metrics.duration_ms
            turn.cost_usd = event.metrics.cost_usd
            turn.outcome_detail = _outcome_detail(event)


def _outcome_detail(event: TerminalOutcome) -> str:
    match event:
        case TurnCompleted():
            return event.reply
        case TurnFailed():
            return event.error
        case TurnPaused():
            return f"paused ({event.reason}): {event.resume_hint}"
        case TurnExhausted():
            return EXHAUSTED_BECAUSE[event.allowance]
        case _:
            assert_never(event)


# -- JSON --------------------------------------------------------------------------------
def state_json(view: ConversationView) -> dict[str, Any]:
    state = view.state
    active = state.active
    return {
        "conversation_id": state.conversation_id,
        "events_applied": state.events_applied,
        "history": [
            {"role": h.role, "content": h.content, "occurred_at": h.occurred_at, "turn_id": h.turn_id,
             "outcome": h.outcome, "withheld": h.withheld}
            for h in state.history
        ],
        "pending": [
            {"input_id": p.input_id, "kind": p.kind, "source": p.source, "content": p.content,
             "occurred_at": p.occurred_at}
            for p in state.pending.values()
        ],
        "rejected": dict(state.rejected),
        "active": None
        if active is None
        else {
            "turn_id": active.turn_id,
            "input_ids": list(active.input_ids),
            "claimed_at": active.claimed_at,
            "run_id": active.run_id,
            "attempt": active.attempt,
            "attempt_state": active.attempt_state,
            "model": active.model,
            "iterations": active.iterations,
            "tool_calls": active.tool_calls,
        },
        "turns": [turn_summary_json(t) for t in turn_summaries(view)],
        # What `POST .../approve|deny` takes, without reading it out of the turn's hint.
        "awaiting_approval": None
        if (paused := awaiting_approval(state)) is None or (call := paused.pending_call) is None
        else {"turn_id": paused.turn_id, "call_id": call.call_id, "tool": call.name, "arguments": call.arguments},
    }


@dataclass(frozen=True, slots=True)
class TurnSummary:
    """One line of a conversation's turns. `detailed` is False for a turn whose events the
    view did not fold -- they came before the snapshot it started from (a restart, a moved
    partition, a conversation back from the local store) -- and that only the state knows:
    its inputs, outcome and attempts, and for an active one its claim and steps so far; what
    the state does not keep is None (the turn's own page reads its timeline from the log)."""

    turn_id: str
    input_ids: tuple[str, ...]
    claimed_at: int | None
    attempts: int
    iterations: int | None
    tool_calls: int | None
    outcome: str | None
    cost_usd: float | None
    duration_ms: int | None
    detailed: bool = True


def summary_of(turn: TurnView) -> TurnSummary:
    return TurnSummary(
        turn.turn_id, turn.input_ids, turn.claimed_at, len(turn.attempts), turn.iterations, len(turn.tool_calls),
        turn.outcome, turn.cost_usd, turn.duration_ms,
    )  # fmt: skip


def turn_summaries(view: ConversationView) -> list[TurnSummary]:
    """Every turn of the conversation, in claim order: those only the state knows (from
    before the view's first event), then the view's own."""
    seen, state = view.turns, view.state
    earlier = [
        TurnSummary(r.turn_id, r.input_ids, None, r.attempts, None, None, r.outcome, None, None, detailed=False)
        for r in state.turns.values()
        if r.turn_id not in seen
    ]
    active = state.active
    if active is not None and active.turn_id not in seen:
        claimed, attempt = active.claimed_at, active.attempt
        steps = (active.iterations, active.tool_calls)
        earlier.append(TurnSummary(active.turn_id, active.input_ids, claimed, attempt, *steps, None, active.cost_usd,
                                   None, detailed=False))  # fmt: skip
    return earlier + [summary_of(turn) for turn in seen.values()]


def turn_count(view: ConversationView) -> int:
    """`len(turn_summaries(view))`, without making them."""
    seen, state = view.turns, view.state
    unseen = sum(turn_id not in seen for turn_id in state.turns)
    active = state.active is not None and state.active.turn_id not in seen
    return len(seen) + unseen + active


def turn_summary_json(turn: TurnSummary) -> dict[str, Any]:
    return {
        "turn_id": turn.turn_id,
        "input_ids": list(turn.input_ids),
        "claimed_at": turn.claimed_at,
        "attempts": turn.attempts,
        "iterations": turn.iterations,
        "tool_calls": turn.tool_calls,
        "outcome": turn.outcome,
        "cost_usd": turn.cost_usd,
        "duration_ms": turn.duration_ms,
    }


def turn_json(conversation_id: str, turn: TurnView) -> dict[str, Any]:
    return {
        "conversation_id": conversation_id,
        **turn_summary_json(summary_of(turn)),
        "outcome_detail": turn.outcome_detail,
        "ended_at": turn.ended_at,
        "input_tokens": turn.input_tokens,
        "output_tokens": turn.output_tokens,
        "protocol_failures": turn.protocol_failures,
        "fallbacks": turn.fallbacks,
        "attempts": [
            {"attempt": a.attempt, "run_id": a.run_id, "model": a.model, "started_at": a.started_at,
             "iterations": a.iterations, "failed": a.failed, "retryable": a.retryable}
            for a in turn.attempts
        ],
        "tool_calls": [
            {"call_id": c.call_id, "tool": c.tool, "iteration": c.iteration, "side_effect": c.side_effect,
             "status": c.status}
            for c in turn.tool_calls
        ],
        "timeline": [
            {"partition": e.partition, "offset": e.offset, "occurred_at": e.occurred_at, "type": e.type,
             "text": e.text, "ignored": e.ignored}
            for e in turn.entries
        ],
    }
