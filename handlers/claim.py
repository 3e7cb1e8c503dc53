"""When to claim, and what: the bounded debounce, the claim of exact pending inputs, and
the double-text policy for messages that arrive while a turn is active."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal

import orjson

from turnstile.events import Event, MessageReceived, MessageRejected, ResumeRequested, TurnClaimed, logical_turn_id
from turnstile.events.lifecycle import MAX_CLAIMED_INPUTS
from turnstile.events.rejections import RejectionReason
from turnstile.projections import ConversationState, PendingInput

# A debounce longer than this is a misconfiguration, not a policy.
MAX_DEBOUNCE_MS = 86_400_000
# The bytes of input ids one claim carries at most: far under any topic's limit (the smallest
# a topic is usually given is ~100 KB), and ~1,700 ids of 36 characters.
CLAIM_IDS_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class DebouncePolicy:
    """Rapid messages are batched: claim once the conversation has been quiet for
    `quiet_ms`, but never later than `max_wait_ms` after the oldest pending input, and
    never more than `max_batch` inputs in one turn (a burst becomes several bounded turns).
    The times are the producers' stamps; inputs whose oldest is stamped more than
    `max_wait_ms` ahead of the worker's clock are claimed at once.
    """

    quiet_ms: int = 1000
    max_wait_ms: int = 3000
    max_batch: int = 20

    def __post_init__(self) -> None:
        if self.quiet_ms < 0 or self.max_wait_ms < 0 or self.max_batch < 1:
            raise ValueError("quiet_ms and max_wait_ms must be >= 0 and max_batch >= 1")
        if max(self.quiet_ms, self.max_wait_ms) > MAX_DEBOUNCE_MS:
            raise ValueError(f"quiet_ms and max_wait_ms must be at most {MAX_DEBOUNCE_MS:,} (a day): longer, "
                             "a conversation's messages wait unanswered for longer than a user does")  # fmt: skip
        if self.max_batch > MAX_CLAIMED_INPUTS:
            raise ValueError(f"max_batch must be at most {MAX_CLAIMED_INPUTS:,}, the inputs a claim names at most")


@dataclass(frozen=True, slots=True)
class ClaimPlan:
    """The exact inputs of the next logical turn, in the order the model will see them."""

    turn_id: str
    inputs: tuple[PendingInput, ...]
    history_boundary: int

    @property
    def input_ids(self) -> tuple[str, ...]:
        return tuple(i.input_id for i in self.inputs)


@dataclass(frozen=True, slots=True)
class WaitUntil:
    """Nothing to claim yet; look again at `due_ms`."""

    due_ms: int


def plan_claim(state: ConversationState, now_ms: int, policy: DebouncePolicy) -> ClaimPlan | WaitUntil | None:
    """None when there is nothing to do: no pending input, or a turn is active (its
    outcome on the log is what makes the conversation claimable again)."""
    if state.active is not None or not state.pending:
        return None
    ordered = _in_claim_order(state.pending.values())
    batch = _next_claim(ordered, policy)
    due = min(ordered[-1].occurred_at + policy.quiet_ms, ordered[0].occurred_at + policy.max_wait_ms)
    # The oldest stamped ahead of this clock by more than the wait allows (a producer's clock
    # far off, or a stamp that is no time at all): waiting for it would hold the conversation
    # that long. A smaller skew keeps the debounce, its wait then at most twice max_wait_ms.
    ahead = ordered[0].occurred_at > now_ms + policy.max_wait_ms
    if len(ordered) < policy.max_batch and now_ms < due and not ahead:
        return WaitUntil(due)
    return ClaimPlan(logical_turn_id(i.input_id for i in batch), batch, len(state.history))


def claims_ahead(pending: Iterable[PendingInput], policy: DebouncePolicy) -> Iterator[tuple[PendingInput, ...]]:
    """The claims that will take `pending`, in order, if no other input arrives first: the
    turn an input just written will run in (an operator's decision behind many messages may
    not be in the next one)."""
    ordered = _in_claim_order(pending)
    while ordered:
        batch = _next_claim(ordered, policy)
        yield batch
        ordered = ordered[len(batch) :]


def _in_claim_order(pending: Iterable[PendingInput]) -> list[PendingInput]:
    # Producers' timestamps give the order the user wrote in; the log order breaks ties.
    return sorted(pending, key=lambda p: p.occurred_at)


def _next_claim(ordered: list[PendingInput], policy: DebouncePolicy) -> tuple[PendingInput, ...]:
    return _within_a_claim(ordered[: policy.max_batch])


def _within_a_claim(inputs: list[PendingInput]) -> tuple[PendingInput, ...]:
    """The first of `inputs` whose ids, as the claim writes them, fit `CLAIM_IDS_BYTES`: ids
    of control characters escape to six bytes each, and a claim past the log's limit could
    never be written (the conversation would be stuck). The rest wait for the next turn."""
    size = 0
    for count, item in enumerate(inputs):
        size += len(orjson.dumps(item.input_id)) + 1
        if size > CLAIM_IDS_BYTES and count:
            return tuple(inputs[:count])
    return tuple(inputs)


def claim_event(state: ConversationState, plan: ClaimPlan, *, event_id: str, run_id: str, now_ms: int) -> TurnClaimed:
    return TurnClaimed(
        event_id=event_id,
        conversation_id=state.conversation_id,
        occurred_at=now_ms,
        turn_id=plan.turn_id,
        run_id=run_id,
        attempt=1,
        input_ids=plan.input_ids,
        history_boundary=plan.history_boundary,
    )


DoubleText = Literal["enqueue", "reject", "interrupt"]
DOUBLE_TEXT_POLICIES: tuple[DoubleText, ...] = ("enqueue", "reject", "interrupt")
REJECTION_TEXT = (
    "I'm still answering your earlier message, so this one was not taken. "
    "Please send it again once the reply has arrived."
)


@dataclass(frozen=True, slots=True)
class DoubleTextPolicy:
    """What a conversation does with a message that arrives while one of its turns is
    active. `enqueue` (the default): it stays pending and starts the next turn (rule 3).
    `reject`: it is answered at once with `MessageRejected` and never claimed.
    `interrupt`: it withdraws the turn if no side-effecting call has started yet
    (`TurnInterrupted`; the turn's messages return to pending and the next claim takes old
    and new together); once a side effect has started it waits, as under `enqueue`.

    "Arrives while a turn is active" is judged on the log: the message is folded while the
    conversation has an active turn (between a `TurnClaimed` and its outcome), so every
    reader, an auditor included, reaches the same verdict."""

    default: DoubleText = "enqueue"
    per_conversation: Mapping[str, DoubleText] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for policy in (self.default, *self.per_conversation.values()):
            if policy not in DOUBLE_TEXT_POLICIES:
                raise ValueError(f"unknown double-text policy {policy!r}")

    def of(self, conversation_id: str) -> DoubleText:
        return self.per_conversation.get(conversation_id, self.default)


def rejects_on_arrival(policy: DoubleTextPolicy, state: ConversationState, message_id: str) -> bool:
    """Call right after `message_id` was folded: True when the policy refuses it."""
    item = state.pending.get(message_id)
    return (
        state.active is not None
        and item is not None
        and item.kind == "message"
        and policy.of(state.conversation_id) == "reject"
    )


def interrupts_on_arrival(policy: DoubleTextPolicy, state: ConversationState, event: Event) -> MessageReceived | None:
    """Call right after `event` was folded: the message that asks the active turn to stop
    under the `interrupt` policy (whether it can, the turn's own state decides:
    `handlers.turn_machine.interruptible`)."""
    if not isinstance(event, MessageReceived) or state.active is None:
        return None
    item = state.pending.get(event.message_id)
    if item is None or item.kind != "message" or policy.of(state.conversation_id) != "interrupt":
        return None
    return event


# What a resume continues, in a new turn that sees it: a turn paused (on an approval, a
# budget), failed (a provider down past its retries) or exhausted. A completed turn left
# nothing to continue: a new message asks for more.
RESUMABLE = frozenset({"paused", "failed", "exhausted"})


def resume_refusal(state: ConversationState, resume: ResumeRequested) -> str | None:
    """Call right after `resume` was folded: why it is refused, or None when it names a
    resumable turn of this conversation (`RESUMABLE`). Turn ids are per conversation:
    another conversation's turn is unknown here."""
    if resume.request_id not in state.pending:
        return None  # a duplicate, or already claimed or refused
    record = state.turns.get(resume.resumes_turn_id)
    named = f"This resume names turn {resume.resumes_turn_id}, which"
    if record is None:
        return f"{named} is not a turn of this conversation; nothing was resumed."
    if record.outcome not in RESUMABLE:
        return f"{named} {record.outcome}: only a paused, failed or exhausted turn is resumed; nothing was resumed."
    if record.pending_call is not None:  # its approval decides it: a resume would leave the grant open
        call = record.pending_call.call_id
        return f"{named} waits for the approval of call {call}: approve or deny it; nothing was resumed."
    if refused_by_model(state, record.turn_id):
        return f"{named} the model refused: {NOTHING_TO_CONTINUE}; nothing was resumed."
    return None


# Why a turn the model refused is not resumed: its inputs are withheld from every later turn
# (`HistoryEntry.withheld`), so its resume would ask the model to continue nothing.
NOTHING_TO_CONTINUE = "its inputs are no longer sent, so there is nothing to continue: send a new message instead"


def refused_by_model(state: ConversationState, turn_id: str) -> bool:
    """Whether `turn_id` ended in the model's refusal (its inputs are withheld)."""
    return any(h.withheld for h in state.history if h.turn_id == turn_id)


@dataclass(frozen=True, slots=True)
class Refusal:
    """An input to answer with `MessageRejected` instead of claiming it. `turn_id`: the
    active turn (`turn_active`) or the turn a resume named (`resume_invalid`)."""

    reason: RejectionReason
    turn_id: str
    text: str


def refusal_on_arrival(policy: DoubleTextPolicy, state: ConversationState, event: Event) -> Refusal | None:
    """Call right after `event` was folded: the refusal owed for the input it brought."""
    if isinstance(event, MessageReceived) and rejects_on_arrival(policy, state, event.message_id):
        assert state.active is not None
        return Refusal("turn_active", state.active.turn_id, REJECTION_TEXT)
    if isinstance(event, ResumeRequested):
        why = resume_refusal(state, event)
        if why is not None:
            return Refusal("resume_invalid", event.resumes_turn_id, why)
    return None


def rejection_event(
    state: ConversationState, input_id: str, refusal: Refusal, *, event_id: str, now_ms: int
) -> MessageRejected:
    turn = {"active_turn_id" if refusal.reason == "turn_active" else "resumes_turn_id": refusal.turn_id}
    return MessageRejected.model_validate(
        {
            "event_id": event_id,
            "conversation_id": state.conversation_id,
            "occurred_at": now_ms,
            "message_id": input_id,
            "reason": refusal.reason,
            "text": refusal.text,
            **turn,
        }
    )
