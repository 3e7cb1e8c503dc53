"""Inputs: what users, schedules and operators put on the log for the engine to answer."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from events.base import Envelope, Identifier

Content = Annotated[str, Field(min_length=1, max_length=200_000)]


class MessageReceived(Envelope):
    """A user message. `message_id` is chosen by the producer and is the idempotency key:
    publishing the same message twice is harmless, reusing an id for other content is
    rejected to the dead-letter topic."""

    type: Literal["MessageReceived"] = "MessageReceived"
    message_id: Identifier
    content: Content


class InputInjected(Envelope):
    """A synthetic user input from a schedule occurrence, an external event or an approval.
    `occurrence_key` is stable (for a schedule: schedule id + occurrence time), so the
    same occurrence injected twice yields one input and one logical turn."""

    type: Literal["InputInjected"] = "InputInjected"
    occurrence_key: Identifier
    source: Literal["schedule", "event", "approval"]
    content: Content


class ResumeRequested(Envelope):
    """The user asks to continue after a paused or failed turn. It is a new logical turn:
    the user has seen the previous outcome."""

    type: Literal["ResumeRequested"] = "ResumeRequested"
    request_id: Identifier
    resumes_turn_id: Identifier
    content: Content = "Continue."
