"""turnstile's public contract: every event on the log, its envelope and its codec."""

from turnstile.events.base import SCHEMA_VERSION, Envelope, TurnEnvelope
from turnstile.events.codec import DecodeError, decode, decode_record, encode
from turnstile.events.dead_letter import DeadLetter
from turnstile.events.identity import content_fingerprint, logical_turn_id
from turnstile.events.inputs import Approval, InputInjected, MessageReceived, ResumeRequested
from turnstile.events.lifecycle import (
    STOPPED_MID_ATTEMPT,
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
    TurnInterrupted,
    Usage,
)
from turnstile.events.outcomes import (
    OperationRecord,
    TurnCompleted,
    TurnExhausted,
    TurnFailed,
    TurnMetrics,
    TurnPaused,
)
from turnstile.events.rejections import MessageRejected
from turnstile.events.union import (
    EVENT_ADAPTER,
    INPUT_TYPES,
    OUTCOME_TYPES,
    STEP_TYPES,
    Event,
    InputEvent,
    TerminalOutcome,
    TurnEvent,
    input_id,
)

__all__ = [
    "EVENT_ADAPTER",
    "INPUT_TYPES",
    "OUTCOME_TYPES",
    "SCHEMA_VERSION",
    "STEP_TYPES",
    "STOPPED_MID_ATTEMPT",
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
    "TurnInterrupted",
    "TurnMetrics",
    "TurnPaused",
    "Usage",
    "content_fingerprint",
    "decode",
    "decode_record",
    "encode",
    "input_id",
    "logical_turn_id",
]
