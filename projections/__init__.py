"""Pure folds over the event log: the same events always give the same state."""

from turnstile.projections.conversation import Rejection, apply_event, new_state
from turnstile.projections.state import (
    ActiveTurn,
    ApprovalGrant,
    AttemptVerdict,
    ConversationState,
    HistoryEntry,
    Operation,
    PendingInput,
    TurnRecord,
)
from turnstile.projections.status import STATUSES, Status, conversation_status

__all__ = [
    "STATUSES",
    "ActiveTurn",
    "ApprovalGrant",
    "AttemptVerdict",
    "ConversationState",
    "HistoryEntry",
    "Operation",
    "PendingInput",
    "Rejection",
    "Status",
    "TurnRecord",
    "apply_event",
    "conversation_status",
    "new_state",
]
