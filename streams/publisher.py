"""Publishing inputs: what a Python service calls to put a user message on the log."""

from __future__ import annotations

import uuid
from typing import Any

from turnstile.events import InputEvent, MessageReceived, encode
from turnstile.streams.log import EventLog, Topics
from turnstile.streams.tracing import trace_headers


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


async def publish(log: EventLog, event: InputEvent) -> tuple[int, int]:
    """Appends keyed by conversation id, so the default partitioner keeps a conversation
    in one partition, with the current trace context in its headers (when tracing).
    Returns (partition, offset)."""
    return await log.append(log.topics.events, event.conversation_id, encode(event), headers=trace_headers())


class KafkaPublisher:
    """For a Python service that only publishes inputs: one idempotent aiokafka producer
    (acks from every in-sync replica; a retried send is written once), keyed by
    conversation id with Kafka's default murmur2 partitioner.

        async with KafkaPublisher("127.0.0.1:9092") as publisher:
            partition, offset = await publisher.publish(message_event("c1", "hi", now_ms, "m-1"))
    """

    def __init__(self, bootstrap: str, topics: Topics = Topics(), client_id: str = "turnstile-publisher") -> None:
        self.topics = topics
        self._options = {"bootstrap_servers": bootstrap, "client_id": client_id, "enable_idempotence": True,
                         "acks": "all"}
        self._producer: Any = None

    @property
    def producer(self) -> Any:
        """Made on first use, inside the running loop aiokafka binds it to: a publisher may be
        created before any loop runs."""
        if self._producer is None:
            from aiokafka import AIOKafkaProducer

            self._producer = AIOKafkaProducer(**self._options)
        return self._producer

    async def __aenter__(self) -> KafkaPublisher:
        await self.producer.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.producer.stop()

    async def publish(self, event: InputEvent) -> tuple[int, int]:
        """Returns (partition, offset) once the broker has the event."""
        headers = [(name, text.encode()) for name, text in trace_headers().items()] or None
        meta = await self.producer.send_and_wait(
            self.topics.events, encode(event), key=event.conversation_id.encode(), headers=headers
        )
        return meta.partition, meta.offset
