"""Publishing inputs: what a Python service calls to put a user message on the log."""

from __future__ import annotations

import uuid
from typing import Any

from turnstile.events import InputEvent, MessageReceived, encode
from turnstile.streams.log import BROKER_DEFAULT_MAX_MESSAGE_BYTES, EventLog, RecordRefused, Topics, value_limit
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
        self._bootstrap = bootstrap
        self._options = {"bootstrap_servers": bootstrap, "client_id": client_id, "enable_idempotence": True,
                         "acks": "all"}
        self._producer: Any = None
        self._limit = BROKER_DEFAULT_MAX_MESSAGE_BYTES  # the events topic's, read when it starts

    @property
    def producer(self) -> Any:
        """Made on first use, inside the running loop aiokafka binds it to: a publisher may be
        created before any loop runs."""
        if self._producer is None:
            from aiokafka import AIOKafkaProducer

            self._producer = AIOKafkaProducer(**self._options)
        return self._producer

    async def __aenter__(self) -> KafkaPublisher:
        from turnstile.streams.kafka_log import topic_max_message_bytes

        # The topic's limit, as the worker reads it: a value the broker refuses for its size
        # would break the idempotent producer's sequence of its partition, and every later
        # publish there would fail out of order; it is refused before it is sent instead.
        limits = await topic_max_message_bytes(self._bootstrap, [self.topics.events])
        self._limit = limits.get(self.topics.events, BROKER_DEFAULT_MAX_MESSAGE_BYTES)
        await self.producer.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.producer.stop()

    async def publish(self, event: InputEvent) -> tuple[int, int]:
        """Returns (partition, offset) once the broker has the event; `RecordRefused` (nothing
        sent) when the events topic would refuse it for its size."""
        headers = [(name, text.encode()) for name, text in trace_headers().items()] or None
        value = encode(event)
        limit = value_limit(self._limit, event.conversation_id) - sum(len(k) + len(v) for k, v in headers or ())
        if len(value) > limit:
            topic = self.topics.events
            raise RecordRefused(f"a message of {len(value):,} bytes is over what {topic} takes ({limit:,})")
        meta = await self.producer.send_and_wait(
            self.topics.events, value, key=event.conversation_id.encode(), headers=headers
        )
        return meta.partition, meta.offset
