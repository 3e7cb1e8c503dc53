"""The engine's answer to a message it does not take."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from turnstile.events.base import Envelope, Identifier

# turn_active: the double-text policy refused a message; resume_invalid: a ResumeRequested
# named no paused, failed or exhausted turn of its conversation.
RejectionReason = Literal["turn_active", "resume_invalid"]


class MessageRejected(Envelope):
    """An input the engine does not take. Reason `turn_active`: the conversation's
    double-text policy is `reject` and the message arrived while a turn of the
    conversation was active (`active_turn_id`). Reason `resume_invalid`: the input is a
    `ResumeRequested` (`message_id` is its request id) whose `resumes_turn_id` is not a
    paused, failed or exhausted turn of this conversation when it arrived; it is never
    answered as a new turn.

    The message leaves the pending set and no turn will answer it; `text` is the refusal
    to show the user. The worker writes at most one per message, before the conversation
    claims its next turn, so a rejected message is never also claimed."""

    type: Literal["MessageRejected"] = "MessageRejected"
    message_id: Identifier
    reason: RejectionReason
    active_turn_id: Identifier | None = None
    resumes_turn_id: Identifier | None = None
    text: Annotated[str, Field(min_length=1, max_length=2000)]

    @model_validator(mode="after")
    def _names_its_turn(self) -> MessageRejected:
        if self.reason == "turn_active" and self.active_turn_id is None:
            raise ValueError("a turn_active rejection names the active turn (active_turn_id)")
        if self.reason == "resume_invalid" and self.resumes_turn_id is None:
            raise ValueError("a resume_invalid rejection names the turn the resume asked for (resumes_turn_id)")
        return self
