"""One readable line per event, for `turnstile demo`, `tail` and people reading logs."""

from __future__ import annotations

from typing import assert_never

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
    ToolCallFinished,
    ToolCallStarted,
    TurnClaimed,
    TurnCompleted,
    TurnExhausted,
    TurnFailed,
    TurnInterrupted,
    TurnPaused,
)


def _short(text: str | None, limit: int = 70) -> str:
    text = (text or "").replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def describe(event: Event) -> str:
    turn = f"turn {event.turn_id[:8]} " if hasattr(event, "turn_id") else ""
    match event:
        case MessageReceived():
            detail = f"message {event.message_id}: {_short(event.content)!r}"
        case InputInjected():
            detail = f"{event.source} input {event.occurrence_key}: {_short(event.content)!r}"
        case MessageRejected():
            named = event.active_turn_id or event.resumes_turn_id or ""
            detail = f"input {event.message_id} rejected ({event.reason}, turn {named[:8]})"
        case ResumeRequested():
            detail = f"resume of turn {event.resumes_turn_id[:8]}"
        case TurnClaimed():
            detail = f"claims {list(event.input_ids)} (history boundary {event.history_boundary})"
        case AttemptStarted():
            detail = f"attempt {event.attempt} run {event.run_id[:8]} on {event.model}"
        case ModelResponded():
            calls = f", {len(event.tool_calls)} tool call(s)" if event.tool_calls else ""
            detail = f"iteration {event.iteration} {event.model}{calls}: {_short(event.text, 50)!r}"
        case ToolCallStarted():
            detail = f"tool {event.tool} {event.call_id} started{' (side effect)' if event.side_effect else ''}"
        case ToolCallFinished():
            detail = f"tool call {event.call_id} {'ok' if event.ok else 'failed'}"
        case ProtocolFailure():
            detail = f"protocol failure {event.kind}: {_short(event.detail, 50)}"
        case ContextCompacted():
            detail = f"compacted {len(event.compacted_call_ids)} tool exchange(s) ({event.dimension})"
        case FallbackEngaged():
            detail = f"fallback {event.from_model} -> {event.to_model}: {_short(event.reason, 50)}"
        case AttemptFailed():
            detail = f"attempt {event.attempt} failed ({_then(event)}): {event.reason}"
        case TurnCompleted():
            detail = f"COMPLETED {dict(event.statuses)}: {_short(event.reply, 50)!r}"
        case TurnFailed():
            detail = f"FAILED: {_short(event.error)}"
        case TurnPaused():
            detail = f"PAUSED ({event.reason}): {_short(event.resume_hint)}"
        case TurnExhausted():
            detail = f"EXHAUSTED: {EXHAUSTED_BECAUSE[event.allowance]}"
        case TurnInterrupted():
            detail = f"INTERRUPTED by message {event.message_id} (its inputs go back to pending)"
        case _:  # every event type has its line: mypy names the one left out
            assert_never(event)
    return f"{event.type:<17} {turn}{detail}".rstrip()


def _then(failed: AttemptFailed) -> str:
    """What follows the failed attempt, as its event says."""
    if failed.reason == STOPPED_MID_ATTEMPT:
        return "its worker stopped; the next owner takes the turn over"
    return "will retry" if failed.retryable else "final"
