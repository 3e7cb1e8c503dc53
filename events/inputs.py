"""Inputs: what users, schedules and operators put on the log for the engine to answer."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from turnstile.events.base import Envelope, Identifier

MAX_CONTENT_CHARS = 200_000
Content = Annotated[str, Field(min_length=1, max_length=MAX_CONTENT_CHARS)]


class MessageReceived(Envelope):
    """A user message. `message_id` is chosen by the producer and is the idempotency key:
    publishing the same message twice is harmless, reusing an id for other content is
    rejected to the dead-letter topic."""

    type: Literal["MessageReceived"] = "MessageReceived"
    message_id: Identifier
    content: Content


class Approval(BaseModel):
    """The decision on a tool call that paused a turn (`TurnPaused` reason `approval`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    turn_id: Identifier
    call_id: Identifier
    approved: bool


class InputInjected(Envelope):
    """A synthetic user input from a schedule occurrence, an external event or an approval.
    `occurrence_key` is stable (for a schedule: schedule id + occurrence time), so the
    same occurrence injected twice yields one input and one logical turn.

    An approval names the paused call it decides in `approval`; `content` is what the
    model reads (e.g. "Approved: go ahead with the transfer.")."""

    type: Literal["InputInjected"] = "InputInjected"
    occurrence_key: Identifier
    source: Literal["schedule", "event", "approval"]
    content: Content
    approval: Approval | None = None

    @model_validator(mode="after")
    def _approval_only_from_approvals(self) -> InputInjected:
        if self.approval is not None and self.source != "approval":
            raise ValueError("an approval decision must have source 'approval'")
        return self


class ResumeRequested(Envelope):
    """The user asks to continue after a paused (on a budget), failed or exhausted turn. It
    is a new logical turn: the user has seen the previous outcome. A turn paused for an
    approval is continued by the approval's `InputInjected`, not by this."""

    type: Literal["ResumeRequested"] = "ResumeRequested"
    request_id: Identifier
    resumes_turn_id: Identifier
    content: Content = "Continue."
