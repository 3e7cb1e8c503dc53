"""When to claim, and what: the bounded debounce and the claim of exact pending inputs."""

from __future__ import annotations

from dataclasses import dataclass

from events import TurnClaimed, logical_turn_id
from projections import ConversationState, PendingInput


@dataclass(frozen=True, slots=True)
class DebouncePolicy:
    """Rapid messages are batched: claim once the conversation has been quiet for
    `quiet_ms`, but never later than `max_wait_ms` after the oldest pending input, and
    never more than `max_batch` inputs in one turn (a burst becomes several bounded turns).
    """

    quiet_ms: int = 1000
    max_wait_ms: int = 3000
    max_batch: int = 20

    def __post_init__(self) -> None:
        if self.quiet_ms < 0 or self.max_wait_ms < 0 or self.max_batch < 1:
            raise ValueError("quiet_ms and max_wait_ms must be >= 0 and max_batch >= 1")


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
    # Producers' timestamps give the order the user wrote in; the log order breaks ties.
    ordered = sorted(state.pending.values(), key=lambda p: p.occurred_at)
    batch = tuple(ordered[: policy.max_batch])
    due = min(ordered[-1].occurred_at + policy.quiet_ms, ordered[0].occurred_at + policy.max_wait_ms)
    if len(ordered) < policy.max_batch and now_ms < due:
        return WaitUntil(due)
    return ClaimPlan(logical_turn_id(i.input_id for i in batch), batch, len(state.history))


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
