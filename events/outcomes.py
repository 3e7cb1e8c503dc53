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
    # Parts of the totals above (see `Usage`); outcomes written before they existed decode as 0.
    cached_input_tokens: NonNegative = 0
    cache_write_tokens: NonNegative = 0
    reasoning_tokens: NonNegative = 0
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


# Why a turn failed, when the model's reply itself is the reason (None: everything else,
# e.g. a provider error, an internal error, a repeated invalid call).
FailureReason = Literal["refusal", "content_filter"]
# How the `error` of every refusal begins ("The model declined to answer: <what the provider
# said of it>"), since the first version: what tells a refusal where `reason` is not at hand.
REFUSAL_ERROR = "The model declined to answer"


class TurnFailed(_Outcome):
    """The turn cannot proceed safely; `error` is shown to the user. A refusal or a
    content filter keeps what the provider said in `text`."""

    type: Literal["TurnFailed"] = "TurnFailed"
    error: str
    reason: FailureReason | None = None
    text: str | None = None


PauseReason = Literal["tool_calls", "cost", "deadline", "approval"]


class TurnPaused(_Outcome):
    """Durable partial work exists, but a budget or an approval stops further execution."""

    type: Literal["TurnPaused"] = "TurnPaused"
    reason: PauseReason
    kept: str
    resume_hint: str
    # Reason `approval`: the call waiting for a decision, exactly as the model made it.
    pending_call: ToolCall | None = None
    # Calls the model requested that did not run because the turn stopped first (a limit
    # reached, or after the call awaiting approval); `kept` lists them too, so the turn
    # that resumes this one sees them and may make them again.
    blocked_calls: tuple[ToolCall, ...] = ()


# iterations: the turn's iteration allowance was used; output_tokens: the reply was cut off
# at the request's output allowance (or the context window), so `last_text` is partial.
ExhaustedAllowance = Literal["iterations", "output_tokens"]
# What each allowance's running out means, as every view says it.
EXHAUSTED_BECAUSE: dict[ExhaustedAllowance, str] = {
    "iterations": "iteration allowance used without a final answer",
    "output_tokens": "the reply was cut off at its output token limit",
}


class TurnExhausted(_Outcome):
    """An allowance was used up without a complete final answer."""

    type: Literal["TurnExhausted"] = "TurnExhausted"
    last_text: str | None = None
    allowance: ExhaustedAllowance = "iterations"
