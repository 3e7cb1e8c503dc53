"""Turn lifecycle events: the claim, each attempt, each model iteration and tool call."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer, model_validator

from turnstile.events.base import MAX_INT, Identifier, TurnEnvelope

NonNegative = Annotated[int, Field(ge=0, lt=MAX_INT)]


class ToolCall(BaseModel):
    """A tool call as the model requested it. `arguments` is the raw JSON text the model
    produced: it may be malformed, and that is recorded rather than repaired."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    call_id: Identifier
    name: Annotated[str, Field(max_length=256)]
    arguments: Annotated[str, Field(max_length=200_000)]


class Usage(BaseModel):
    """Tokens of one provider response, by how they are billed.

    `input_tokens` is the whole prompt, cached parts included; `cached_input_tokens` and
    `cache_write_tokens` are the parts of it read from and written to the provider's
    prompt cache. `output_tokens` is everything generated; `reasoning_tokens` is the part
    spent on hidden reasoning (billed as output). Events written before the cache fields
    existed decode with them at zero, which is what they measured."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    input_tokens: NonNegative = 0
    output_tokens: NonNegative = 0
    cached_input_tokens: NonNegative = 0
    cache_write_tokens: NonNegative = 0
    reasoning_tokens: NonNegative = 0

    @model_validator(mode="after")
    def _parts_fit_their_totals(self) -> Usage:
        if self.cached_input_tokens + self.cache_write_tokens > self.input_tokens:
            raise ValueError("cached_input_tokens + cache_write_tokens exceed input_tokens")
        if self.reasoning_tokens > self.output_tokens:
            raise ValueError("reasoning_tokens exceed output_tokens")
        return self


# The inputs one turn claims at most (a claim names them all).
MAX_CLAIMED_INPUTS = 10_000


class TurnClaimed(TurnEnvelope):
    """The transition that assigns exact pending inputs to a logical turn (attempt 1).

    `input_ids` is ordered as the inputs are rendered to the model. `history_boundary`
    is the number of history entries the turn sees; everything after it, and the claimed
    inputs themselves, are excluded from history."""

    type: Literal["TurnClaimed"] = "TurnClaimed"
    input_ids: Annotated[tuple[Identifier, ...], Field(min_length=1, max_length=MAX_CLAIMED_INPUTS)]
    history_boundary: NonNegative


class AttemptStarted(TurnEnvelope):
    """One execution of the logical turn. Retries share `turn_id` and get a new `run_id`."""

    type: Literal["AttemptStarted"] = "AttemptStarted"
    model: Identifier
    # Set when this attempt continues the journal of an interrupted run (its owner crashed,
    # lost the partition or ran out of drain grace) instead of starting over: the model
    # steps and tool results of that run are its transcript, and are not made again.
    resumes_run_id: Identifier | None = None


class ModelResponded(TurnEnvelope):
    """One provider response: the first half of a tool iteration."""

    type: Literal["ModelResponded"] = "ModelResponded"
    iteration: Annotated[int, Field(ge=1, lt=MAX_INT)]
    model: Identifier
    text: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    usage: Usage = Usage()
    # None when the model has no known price: the budget then fails closed.
    cost_usd: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
    finish_reason: Annotated[str, Field(max_length=64)] = "stop"


class ToolCallStarted(TurnEnvelope):
    """Written, and acknowledged by the log, before the tool runs. A started call with no
    finish means its side effect may have happened."""

    type: Literal["ToolCallStarted"] = "ToolCallStarted"
    iteration: Annotated[int, Field(ge=1, lt=MAX_INT)]
    call_id: Identifier
    tool: Identifier
    arguments: str
    side_effect: bool
    # The key an idempotent tool receives (derived from turn id and call id): the same on
    # every run of this call, so running it again after an interruption has one effect.
    idempotency_key: Annotated[str, Field(max_length=128)] | None = None


# The result of a side-effecting call whose run stopped while its start was acknowledged,
# before its body began: written only when no earlier run of the turn started that call.
NOT_STARTED = "error: the call did not start (the worker stopped before running it); it had no effect"


class ToolCallFinished(TurnEnvelope):
    """A tool call's result (`ok` false: an error the model reads). A `result` of exactly
    NOT_STARTED says the call never began: it had no effect."""

    type: Literal["ToolCallFinished"] = "ToolCallFinished"
    iteration: Annotated[int, Field(ge=1, lt=MAX_INT)]
    call_id: Identifier
    ok: bool
    result: str
    # True when the result came from the tool's reconciler after an interruption: the
    # call's body did not run again.
    reconciled: bool = False


ProtocolFailureKind = Literal["unknown_tool", "malformed_arguments", "repeated_call", "malformed_response"]


class ProtocolFailure(TurnEnvelope):
    """The model broke the tool protocol (an unknown tool, arguments that do not validate, the
    same invalid call again), or its reply could not be used (`malformed_response`).
    Recorded with model and iteration because model-specific routing is often the cause;
    never a crash. A `malformed_response` the provider reported usage for carries `usage`
    and `cost_usd` (null: the model has no price); both are left out when nothing was
    reported, and `cost_usd` never comes without `usage`."""

    type: Literal["ProtocolFailure"] = "ProtocolFailure"
    iteration: Annotated[int, Field(ge=1, lt=MAX_INT)]
    model: Identifier
    kind: ProtocolFailureKind
    detail: str
    call_id: Identifier | None = None
    signature: str | None = None
    # A `malformed_response` the provider reported tokens for (a whole reply, billed though
    # unusable): counted in the turn's usage and cost as a reply's are, `cost_usd` None
    # meaning an unknown price. Both None when nothing was reported.
    usage: Usage | None = None
    cost_usd: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None

    @model_validator(mode="after")
    def _cost_of_usage(self) -> ProtocolFailure:
        if self.cost_usd is not None and self.usage is None:
            raise ValueError("cost_usd is the cost of usage: it needs usage")
        return self

    @model_serializer(mode="wrap")
    def _unbilled_as_before(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Left out when nothing was reported: such a failure is the same bytes as before
        # these fields existed, which a reader of that version still accepts.
        fields: dict[str, Any] = handler(self)
        if self.usage is None and self.cost_usd is None:
            fields.pop("usage", None)  # (absent already under `exclude=` or `include=`)
            fields.pop("cost_usd", None)
        return fields


class ContextCompacted(TurnEnvelope):
    """Older tool exchanges were replaced by a short summary before the next request."""

    type: Literal["ContextCompacted"] = "ContextCompacted"
    iteration: Annotated[int, Field(ge=1, lt=MAX_INT)]
    compacted_call_ids: tuple[Identifier, ...]
    dimension: Identifier


class FallbackEngaged(TurnEnvelope):
    """The next model of the same protocol family takes the exact same transcript."""

    type: Literal["FallbackEngaged"] = "FallbackEngaged"
    from_model: Identifier
    to_model: Identifier
    reason: str


# The `AttemptFailed.reason` of an owner that takes a turn over and closes the run of a
# stopped one (crash, lost partition, drain out of grace). That closing decides nothing
# about the turn -- the new owner goes on from the journal -- whereas any other reason is
# the run's own verdict, which whoever owns the turn next carries out. A fixed text rather
# than a new field: every takeover ever written carries it, so old logs read the same.
STOPPED_MID_ATTEMPT = "the worker running this attempt stopped before it ended"


class AttemptFailed(TurnEnvelope):
    """This attempt ended without an outcome. `retryable` says whether a fresh attempt of
    the same logical turn may follow (never after a side effect; not retryable, the turn
    fails). A `reason` of exactly STOPPED_MID_ATTEMPT is a takeover closing a stopped
    owner's run: the journal may be resumed whatever `retryable` says."""

    type: Literal["AttemptFailed"] = "AttemptFailed"
    reason: str
    retryable: bool


class TurnInterrupted(TurnEnvelope):
    """The `interrupt` double-text policy withdrew this turn: `message_id` arrived while the
    turn had started no side-effecting tool. The turn ends without an outcome, its claimed
    inputs return to the pending set, and the next claim takes them together with the new
    message, in order, as one final input. Written by the run it interrupts; a turn whose
    side effect has started cannot be interrupted (the message waits, as under `enqueue`)."""

    type: Literal["TurnInterrupted"] = "TurnInterrupted"
    message_id: Identifier
