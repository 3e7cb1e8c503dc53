"""Small constructors for events in tests: every field a test does not care about has a
plain default, so each test states only what it is about."""

from __future__ import annotations

import itertools

from turnstile.events import (
    REFUSAL_ERROR,
    AttemptStarted,
    MessageReceived,
    TurnClaimed,
    TurnCompleted,
    TurnFailed,
    TurnMetrics,
    logical_turn_id,
)

_ids = itertools.count(1)
CONV = "conv-1"


def eid() -> str:
    return f"evt-{next(_ids)}"


def message(message_id: str, at: int, content: str | None = None, conv: str = CONV) -> MessageReceived:
    return MessageReceived(
        event_id=eid(), conversation_id=conv, occurred_at=at, message_id=message_id,
        content=content if content is not None else f"text of {message_id}",
    )


def claim(input_ids: list[str], at: int, boundary: int, run_id: str = "run-1", conv: str = CONV) -> TurnClaimed:
    return TurnClaimed(
        event_id=eid(), conversation_id=conv, occurred_at=at, turn_id=logical_turn_id(input_ids),
        run_id=run_id, attempt=1, input_ids=tuple(input_ids), history_boundary=boundary,
    )


def started(c: TurnClaimed, at: int, run_id: str | None = None, attempt: int = 1) -> AttemptStarted:
    return AttemptStarted(
        event_id=eid(), conversation_id=c.conversation_id, occurred_at=at, turn_id=c.turn_id,
        run_id=run_id or c.run_id, attempt=attempt, model="m",
    )


def completed(c: TurnClaimed, at: int, reply: str = "reply", run_id: str | None = None) -> TurnCompleted:
    return TurnCompleted(
        event_id=eid(), conversation_id=c.conversation_id, occurred_at=at, turn_id=c.turn_id,
        run_id=run_id or c.run_id, attempt=1, reply=reply,
        statuses={i: "answered" for i in c.input_ids},
        metrics=TurnMetrics(model="m", attempt=1, iterations=1, tool_calls=0, input_tokens=1,
                            output_tokens=1, cost_usd=0.0, fallbacks=0, duration_ms=at - c.occurred_at),
    )


def refused(c: TurnClaimed, at: int, explanation: str = "This could enable malware.") -> TurnFailed:
    """The outcome of a turn whose reply the model refused, as `handlers.stops` words it."""
    return TurnFailed(
        event_id=eid(), conversation_id=c.conversation_id, occurred_at=at, turn_id=c.turn_id, run_id=c.run_id,
        attempt=1, statuses={i: "failed" for i in c.input_ids}, error=f"{REFUSAL_ERROR}: {explanation}",
        reason="refusal", text="Sure, here",
        metrics=TurnMetrics(model="m", attempt=1, iterations=1, tool_calls=0, input_tokens=1,
                            output_tokens=1, cost_usd=0.0, fallbacks=0, duration_ms=at - c.occurred_at),
    )  # fmt: skip
