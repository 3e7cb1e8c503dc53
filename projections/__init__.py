"""Pure folds over the event log: the same events always give the same state."""

from projections.conversation import Rejection, apply_event, new_state
from projections.state import (
    ActiveTurn,
    ConversationState,
    HistoryEntry,
    Operation,
    PendingInput,
    TurnRecord,
)

__all__ = [
    "ActiveTurn",
    "ConversationState",
    "HistoryEntry",
    "Operation",
    "PendingInput",
    "Rejection",
    "TurnRecord",
    "apply_event",
    "new_state",
]
