"""Pure folds over the event log: the same events always give the same state."""

from turnstile.projections.conversation import Rejection, apply_event, new_state
from turnstile.projections.state import (
    ActiveTurn,
    ApprovalGrant,
    ConversationState,
    HistoryEntry,
    Operation,
    PendingInput,
    TurnRecord,
)

__all__ = [
    "ActiveTurn",
    "ApprovalGrant",
    "ConversationState",
    "HistoryEntry",
    "Operation",
    "PendingInput",
    "Rejection",
    "TurnRecord",
    "apply_event",
    "new_state",
]
