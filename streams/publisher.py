"""Publishing inputs: what a Python service calls to put a user message on the log."""

from __future__ import annotations

import uuid

from events import MessageReceived, encode
from streams.log import EventLog


def message_event(conversation_id: str, content: str, now_ms: int, message_id: str | None = None) -> MessageReceived:
    """`message_id` is the idempotency key: pass the id your service already has for the
    message, so that publishing it again (a retry after a timeout) is harmless."""
    return MessageReceived(
        event_id=uuid.uuid4().hex,
        conversation_id=conversation_id,
        occurred_at=now_ms,
        message_id=message_id or uuid.uuid4().hex,
        content=content,
    )


async def publish(log: EventLog, event: MessageReceived) -> tuple[int, int]:
    """Appends keyed by conversation id, so the default partitioner keeps a conversation
    in one partition. Returns (partition, offset)."""
    return await log.append(log.topics.events, event.conversation_id, encode(event))
