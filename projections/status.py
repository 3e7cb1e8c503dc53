"""What an operator's list says of a conversation, decided from its folded state alone."""

from __future__ import annotations

from typing import Literal, get_args

from turnstile.projections.state import ConversationState

Status = Literal["idle", "debouncing", "active", "paused", "failed"]
STATUSES: tuple[Status, ...] = get_args(Status)


def conversation_status(state: ConversationState) -> Status:
    """`active`: a turn is claimed and has no outcome yet. `debouncing`: inputs wait for a
    claim (the debounce window, or a worker's next decision). Otherwise the last turn's
    outcome says it: `paused` (an approval or a budget waits for a person), `failed`
    (failed or exhausted: a resume may continue it), else `idle`."""
    if state.active is not None:
        return "active"
    if state.pending:
        return "debouncing"
    if not state.turns:
        return "idle"
    last = next(reversed(state.turns.values())).outcome
    if last == "paused":
        return "paused"
    if last in ("failed", "exhausted"):
        return "failed"
    return "idle"
