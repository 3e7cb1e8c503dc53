"""The one discriminated union of every event, keyed by `type`."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, TypeAdapter

from turnstile.events.inputs import InputInjected, MessageReceived, ResumeRequested
from turnstile.events.lifecycle import (
    AttemptFailed,
    AttemptStarted,
    ContextCompacted,
    FallbackEngaged,
    ModelResponded,
    ProtocolFailure,
    ToolCallFinished,
    ToolCallStarted,
    TurnClaimed,
    TurnInterrupted,
)
from turnstile.events.outcomes import TurnCompleted, TurnExhausted, TurnFailed, TurnPaused
from turnstile.events.rejections import MessageRejected

InputEvent = MessageReceived | InputInjected | ResumeRequested
TerminalOutcome = TurnCompleted | TurnFailed | TurnPaused | TurnExhausted
TurnEvent = (
    TurnClaimed
    | AttemptStarted
    | ModelResponded
    | ToolCallStarted
    | ToolCallFinished
    | ProtocolFailure
    | ContextCompacted
    | FallbackEngaged
    | AttemptFailed
    | TurnInterrupted
    | TerminalOutcome
)

Event = Annotated[InputEvent | TurnEvent | MessageRejected, Field(discriminator="type")]

EVENT_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)

INPUT_TYPES = (MessageReceived, InputInjected, ResumeRequested)
OUTCOME_TYPES = (TurnCompleted, TurnFailed, TurnPaused, TurnExhausted)
# The steps inside a turn, between its claim and its end: they change neither the pending set
# nor which turn is active (a reader's "is it paused, running, idle" stays as it was).
STEP_TYPES = (AttemptStarted, ModelResponded, ToolCallStarted, ToolCallFinished, ProtocolFailure, ContextCompacted,
              FallbackEngaged, AttemptFailed)


def input_id(event: InputEvent) -> str:
    """The id an input is pending, claimed (`TurnClaimed.input_ids`) and answered
    (an outcome's `statuses`) under."""
    match event:
        case MessageReceived():
            return event.message_id
        case InputInjected():
            return event.occurrence_key
        case ResumeRequested():
            return event.request_id
