"""Building the terminal outcome of a turn from its folded state: metrics, statuses and
the record of operations. Pure: the time and ids come in as arguments."""

from __future__ import annotations

from dataclasses import dataclass

from turnstile.events import (
    OperationRecord,
    ToolCall,
    TurnCompleted,
    TurnExhausted,
    TurnFailed,
    TurnMetrics,
    TurnPaused,
)
from turnstile.events.outcomes import ExhaustedAllowance, FailureReason, InputStatus, PauseReason
from turnstile.projections import ActiveTurn


@dataclass(frozen=True, slots=True)
class Stamp:
    """Who writes an event and when: the identity fields every turn event carries."""

    event_id: str
    conversation_id: str
    now_ms: int

    def of(self, turn: ActiveTurn) -> dict[str, str | int]:
        return {
            "event_id": self.event_id,
            "conversation_id": self.conversation_id,
            "occurred_at": self.now_ms,
            "turn_id": turn.turn_id,
            "run_id": turn.run_id,
            "attempt": turn.attempt,
        }


def metrics_of(turn: ActiveTurn, now_ms: int, default_model: str) -> TurnMetrics:
    return TurnMetrics(
        model=turn.model or default_model,
        attempt=turn.attempt,
        iterations=turn.iterations,
        tool_calls=turn.tool_calls,
        input_tokens=turn.input_tokens,
        output_tokens=turn.output_tokens,
        cached_input_tokens=turn.cached_input_tokens,
        cache_write_tokens=turn.cache_write_tokens,
        reasoning_tokens=turn.reasoning_tokens,
        cost_usd=turn.cost_usd,
        fallbacks=turn.fallbacks,
        duration_ms=max(0, now_ms - turn.claimed_at),
    )


def operations_of(turn: ActiveTurn) -> tuple[OperationRecord, ...]:
    """Started-but-unfinished calls are `unknown`: their side effect may have happened."""
    return tuple(
        OperationRecord(
            call_id=op.call_id,
            tool=op.tool,
            side_effect=op.side_effect,
            status="unknown" if op.status == "started" else op.status,
        )
        for op in turn.operations.values()
    )


def _common(turn: ActiveTurn, stamp: Stamp, status: InputStatus, default_model: str) -> dict[str, object]:
    return {
        **stamp.of(turn),
        "statuses": {input_id: status for input_id in turn.input_ids},
        "metrics": metrics_of(turn, stamp.now_ms, default_model),
        "operations": operations_of(turn),
    }


def completed(turn: ActiveTurn, stamp: Stamp, reply: str, default_model: str) -> TurnCompleted:
    return TurnCompleted.model_validate({**_common(turn, stamp, "answered", default_model), "reply": reply})


def failed(
    turn: ActiveTurn,
    stamp: Stamp,
    error: str,
    default_model: str,
    reason: FailureReason | None = None,
    text: str | None = None,
) -> TurnFailed:
    common = _common(turn, stamp, "failed", default_model)
    return TurnFailed.model_validate({**common, "error": error, "reason": reason, "text": text})


def paused(
    turn: ActiveTurn,
    stamp: Stamp,
    reason: PauseReason,
    kept: str,
    resume_hint: str,
    default_model: str,
    pending_call: ToolCall | None = None,
    blocked_calls: tuple[ToolCall, ...] = (),
) -> TurnPaused:
    return TurnPaused.model_validate(
        {
            **_common(turn, stamp, "paused", default_model),
            "reason": reason,
            "kept": kept,
            "resume_hint": resume_hint,
            "pending_call": pending_call,
            "blocked_calls": blocked_calls,
        }
    )


def exhausted(
    turn: ActiveTurn,
    stamp: Stamp,
    last_text: str | None,
    default_model: str,
    allowance: ExhaustedAllowance = "iterations",
) -> TurnExhausted:
    common = _common(turn, stamp, "exhausted", default_model)
    return TurnExhausted.model_validate({**common, "last_text": last_text, "allowance": allowance})
