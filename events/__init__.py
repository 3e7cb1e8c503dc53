"""turnstile's public contract: every event on the log, its envelope and its codec."""

from events.base import SCHEMA_VERSION, Envelope, TurnEnvelope
from events.codec import DEFAULT_MAX_VALUE_BYTES, DecodeError, decode, encode
from events.dead_letter import DeadLetter
from events.identity import content_fingerprint, logical_turn_id
from events.inputs import Approval, InputInjected, MessageReceived, ResumeRequested
from events.lifecycle import (
    AttemptFailed,
    AttemptStarted,
    ContextCompacted,
    FallbackEngaged,
    ModelResponded,
    ProtocolFailure,
    ToolCall,
    ToolCallFinished,
    ToolCallStarted,
    TurnClaimed,
    Usage,
)
from events.outcomes import (
    OperationRecord,
    TurnCompleted,
    TurnExhausted,
    TurnFailed,
    TurnMetrics,
    TurnPaused,
)
from events.rejections import MessageRejected
from events.union import (
    EVENT_ADAPTER,
    INPUT_TYPES,
    OUTCOME_TYPES,
    Event,
    InputEvent,
    TerminalOutcome,
    TurnEvent,
)

__all__ = [
    "DEFAULT_MAX_VALUE_BYTES",
    "EVENT_ADAPTER",
    "INPUT_TYPES",
    "OUTCOME_TYPES",
    "SCHEMA_VERSION",
    "Approval",
    "AttemptFailed",
    "AttemptStarted",
    "ContextCompacted",
    "DeadLetter",
    "DecodeError",
    "Envelope",
    "Event",
    "FallbackEngaged",
    "InputEvent",
    "InputInjected",
    "MessageReceived",
    "MessageRejected",
    "ModelResponded",
    "OperationRecord",
    "ProtocolFailure",
    "ResumeRequested",
    "TerminalOutcome",
    "ToolCall",
    "ToolCallFinished",
    "ToolCallStarted",
    "TurnClaimed",
    "TurnCompleted",
    "TurnEnvelope",
    "TurnEvent",
    "TurnExhausted",
    "TurnFailed",
    "TurnMetrics",
    "TurnPaused",
    "Usage",
    "content_fingerprint",
    "decode",
    "encode",
    "logical_turn_id",
]
