"""The state a conversation folds to. Plain mutable records owned by the fold.

They are mutable on purpose: the fold is on the hot path of every consumed event and
must cost the same at the 10,000th message as at the first, so it appends in place
instead of copying histories. Only the fold writes them; readers take what they need.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from turnstile.events import Event, ToolCall

InputKind = Literal["message", "injected", "resume"]
OperationStatus = Literal["started", "succeeded", "failed"]
AttemptState = Literal["claimed", "open", "closed"]
OutcomeKind = Literal["completed", "failed", "paused", "exhausted"]


@dataclass(frozen=True, slots=True)
class ApprovalGrant:
    """An approval input resolved against the paused turn it decides: the exact call
    (tool and arguments) the user approved or denied."""

    turn_id: str
    call_id: str
    tool: str
    arguments: str
    approved: bool


@dataclass(slots=True)
class PendingInput:
    """One input waiting for a turn: a message, an injected input or a resume request."""

    input_id: str
    kind: InputKind
    content: str
    occurred_at: int
    # Injected inputs: schedule | event | approval. A turn of scheduled inputs only is
    # isolated: nobody is watching, and only tools marked for it are offered.
    source: str | None = None
    grant: ApprovalGrant | None = None


@dataclass(slots=True)
class HistoryEntry:
    """One line of the conversation as later turns see it. Entries are appended only when a
    turn ends, in turn order: the claimed inputs, then what the turn answered."""

    role: Literal["user", "assistant"]
    content: str
    occurred_at: int
    turn_id: str
    outcome: OutcomeKind | None = None  # set on the assistant entry that closes a turn
    # An input of a turn the model refused: later turns send a note in its place, since a
    # provider that refused it refuses every request that carries it again (Anthropic:
    # "Attempting to continue without resetting will result in continued refusals").
    withheld: bool = False


@dataclass(slots=True)
class Operation:
    call_id: str
    tool: str
    side_effect: bool
    status: OperationStatus


@dataclass(frozen=True, slots=True)
class AttemptVerdict:
    """How the last attempt closed (its `AttemptFailed`): what its owner decided, which
    whoever owns the turn next carries out instead of running on (rule 9). `at` is the
    failure's event time, from which a retry's backoff is counted."""

    retryable: bool
    reason: str
    at: int


@dataclass(slots=True)
class ActiveTurn:
    """The one turn that owns the conversation between its claim and its outcome."""

    turn_id: str
    inputs: tuple[PendingInput, ...]
    history_boundary: int
    claimed_at: int
    run_id: str
    attempt: int
    # claimed: TurnClaimed is on the log, its first AttemptStarted not yet;
    # open: the attempt of `run_id` runs; closed: it ended with AttemptFailed.
    attempt_state: AttemptState = "claimed"
    # Closed: the AttemptFailed's verdict (None while claimed or open).
    verdict: AttemptVerdict | None = None
    model: str | None = None
    iterations: int = 0  # of the current attempt
    # Totals over every attempt of the logical turn: budgets bound the turn, not one try.
    tool_calls: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cached_input_tokens: int = 0
    cache_write_tokens: int = 0
    reasoning_tokens: int = 0
    cost_usd: float | None = 0.0
    fallbacks: int = 0
    # Attempts a takeover closed because their worker stopped (`STOPPED_MID_ATTEMPT`: a
    # deploy's rebalance, a crash): attempts, but no failure of the model's. `attempt - stops`
    # is what the model's attempt allowance and backoff count.
    stops: int = 0
    operations: dict[str, Operation] = field(default_factory=dict)
    # Canonical signature of an invalid tool call -> how often the model made it.
    invalid_calls: dict[str, int] = field(default_factory=dict)
    # Event ids of the steps folded into this turn: an exact duplicate (the same event
    # published twice) is ignored instead of counting tokens or tool calls twice.
    step_ids: set[str] = field(default_factory=set)
    # The model steps, tool calls and protocol failures of the current attempt, and of the
    # runs it resumes (`AttemptStarted.resumes_run_id`): what a new owner continues from.
    journal: list[Event] = field(default_factory=list)

    @property
    def input_ids(self) -> tuple[str, ...]:
        return tuple(i.input_id for i in self.inputs)

    @property
    def model_attempts(self) -> int:
        """The attempts that ran to a verdict of their own (or run now): all but the stopped."""
        return self.attempt - self.stops

    @property
    def side_effect_started(self) -> bool:
        """True once any side-effecting tool has started: from then on the turn may have
        changed the world and is never replayed automatically."""
        return any(op.side_effect for op in self.operations.values())


@dataclass(slots=True)
class TurnRecord:
    """What remains of a finished turn: enough to answer "was this input answered, how"."""

    turn_id: str
    input_ids: tuple[str, ...]
    outcome: OutcomeKind
    attempts: int
    # Paused for approval: the call waiting for a decision.
    pending_call: ToolCall | None = None


@dataclass(slots=True)
class ConversationState:
    conversation_id: str
    history: list[HistoryEntry] = field(default_factory=list)
    # Insertion order is log order; the claim sorts by the producers' timestamps.
    pending: dict[str, PendingInput] = field(default_factory=dict)
    active: ActiveTurn | None = None
    turns: dict[str, TurnRecord] = field(default_factory=dict)
    # input id -> fingerprint of its content, for idempotent re-publishing.
    seen_inputs: dict[str, str] = field(default_factory=dict)
    # input id -> the logical turn that claimed it (rule 1).
    claimed_by: dict[str, str] = field(default_factory=dict)
    # message id -> why the double-text policy refused it (`MessageRejected`): never claimed.
    rejected: dict[str, str] = field(default_factory=dict)
    events_applied: int = 0
