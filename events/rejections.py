"""The engine's answer to a message it does not take."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field
from turnstile.events.base import Envelope, Identifier

RejectionReason = Literal["turn_active"]


class MessageRejected(Envelope):
    """A message the conversation's double-text policy refused: the policy is `reject` and
    the message arrived while a turn of the conversation was active (`active_turn_id`).

    The message leaves the pending set and no turn will answer it; `text` is the refusal
    to show the user. The worker writes at most one per message, before the conversation
    claims its next turn, so a rejected message is never also claimed."""

    type: Literal["MessageRejected"] = "MessageRejected"
    message_id: Identifier
    reason: RejectionReason
    active_turn_id: Identifier
    text: Annotated[str, Field(min_length=1, max_length=2000)]
