"""Terminal outcomes: exactly one per logical turn. They carry metrics, never prompt text."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field
from turnstile.events.base import MAX_INT, Identifier, TurnEnvelope
from turnstile.events.lifecycle import ToolCall

NonNegative = Annotated[int, Field(ge=0, lt=MAX_INT)]
InputStatus = Literal["answered", "failed", "paused", "exhausted"]


class TurnMetrics(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    model: Identifier
    attempt: Annotated[int, Field(ge=1, lt=MAX_INT)]
    iterations: NonNegative
    tool_calls: NonNegative
    input_tokens: NonNegative
    output_tokens: NonNegative
    cost_usd: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None
    fallbacks: NonNegative
    duration_ms: NonNegative


class OperationRecord(BaseModel):
    """What a tool call did, as far as the log knows. `unknown` means it started and no
    finish was recorded: the side effect may or may not have happened."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    call_id: Identifier
    tool: Identifier
    side_effect: bool
    status: Literal["succeeded", "failed", "unknown"]


class _Outcome(TurnEnvelope):
    statuses: dict[Identifier, InputStatus]
    metrics: TurnMetrics
    operations: tuple[OperationRecord, ...] = ()


class TurnCompleted(_Outcome):
    """The reply and the statuses of the claimed inputs, committed together."""

    type: Literal["TurnCompleted"] = "TurnCompleted"
    reply: str


class TurnFailed(_Outcome):
    """The turn cannot proceed safely; `error` is shown to the user."""

    type: Literal["TurnFailed"] = "TurnFailed"
    error: str


PauseReason = Literal["tool_calls", "cost", "deadline", "approval"]


class TurnPaused(_Outcome):
    """Durable partial work exists, but a budget or an approval stops further execution."""

    type: Literal["TurnPaused"] = "TurnPaused"
    reason: PauseReason
    kept: str
    resume_hint: str
    # Reason `approval`: the call waiting for a decision, exactly as the model made it.
    pending_call: ToolCall | None = None


class TurnExhausted(_Outcome):
    """The iteration allowance was used without a final answer."""

    type: Literal["TurnExhausted"] = "TurnExhausted"
    last_text: str | None = None
