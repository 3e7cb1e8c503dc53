"""Appends batched per partition per loop cycle, on the real broker: what one cycle appends
goes in one produce per partition, every append gets the offset its record has on the log,
records of a partition land in the order of the calls and on the partition Kafka's default
partitioner picks for their key, and a batch never exceeds what the topic takes -- a record
too large for it alone is refused alone, before it is sent, and the others in its cycle are
written."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from kafka_fixtures import kafka_bootstrap  # noqa: F401  (fixtures)

from turnstile.streams.kafka_log import KafkaLog, ProducerBroken, topic_max_message_bytes
from turnstile.streams.kafka_reader import read_topic
from turnstile.streams.log import RecordRefused, Topics, partition_for
from turnstile.streams.publisher import KafkaPublisher, message_event

pytestmark = pytest.mark.kafka
TOPIC_LIMIT = 10_000  # max.message.bytes of the small topic: one batch may carry no more


async def new_topic(bootstrap: str, **configs: str) -> str:
    name = f"ab-{uuid.uuid4().hex[:8]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, 8, 1, topic_configs=configs)])
    finally:
        await admin.close()
    return name


async def small_topic(bootstrap: str, log: KafkaLog) -> str:
    """A topic that takes at most TOPIC_LIMIT bytes a message, with `log` knowing it."""
    topic = await new_topic(bootstrap, **{"max.message.bytes": str(TOPIC_LIMIT)})
    log.max_message_bytes.update(await topic_max_message_bytes(bootstrap, [topic]))
    return topic


@pytest.fixture
async def log(kafka_bootstrap: str) -> AsyncIterator[KafkaLog]:  # noqa: F811
    suffix = uuid.uuid4().hex[:8]
    log = KafkaLog(kafka_bootstrap, f"g-{suffix}", Topics(f"t-{suffix}.events", f"t-{suffix}.out", f"t-{suffix}.dlq"))
    await log.start_producer()
    yield log
    await log.stop()


class Produces:
    """Counts the produce calls of a producer: batches, and records sent one by one."""

    def __init__(self, log: KafkaLog) -> None:
        self.batches: list[int] = []  # the partition of each batch sent
        self.singles = 0
        producer = log.producer
        send_batch, send_and_wait = producer.send_batch, producer.send_and_wait

        async def counted_batch(batch: Any, topic: str, *, partition: int) -> Any:
            self.batches.append(partition)
            return await send_batch(batch, topic, partition=partition)

        async def counted_single(*args: Any, **kwargs: Any) -> Any:
            self.singles += 1
            return await send_and_wait(*args, **kwargs)

        producer.send_batch = counted_batch  # type: ignore[method-assign]
        producer.send_and_wait = counted_single  # type: ignore[method-assign]


async def test_one_cycles_appends_are_one_produce_per_partition_in_call_order(
    kafka_bootstrap: str,  # noqa: F811
    log: KafkaLog,
) -> None:
    topic = await new_topic(kafka_bootstrap)
    await log.append(topic, "warm-up", b"metadata")  # the first send fetches the topic's metadata
    produces = Produces(log)
    keys = [f"conversation-{i}" for i in range(12)]
    calls = [(keys[i % len(keys)], f"{i:04d}".encode()) for i in range(300)]
    # Given 300 appends made in one loop cycle (gather starts them all before any awaits)
    landed = await asyncio.gather(*(log.append(topic, key, value) for key, value in calls))
    # Then one produce per partition the keys fall on, no record sent alone
    partitions = {partition_for(key, 8) for key in keys}
    assert produces.singles == 0 and sorted(produces.batches) == sorted(partitions)
    # And each append's (partition, offset) is its record's, on its key's partition
    on_log = {(r.partition, r.offset): r for r in await read_topic(kafka_bootstrap, topic)}
    for (key, value), (partition, offset) in zip(calls, landed, strict=True):
        record = on_log[(partition, offset)]
        assert record.key == key.encode() and record.value == value and partition == partition_for(key, 8)
    # And per partition the records are in the order of the calls
    for partition in partitions:
        written = [r.value for (p, _), r in sorted(on_log.items()) if p == partition and r.key != b"warm-up"]
        assert written == [value for key, value in calls if partition_for(key, 8) == partition]


async def test_a_batch_is_split_at_the_topics_limit_and_a_record_too_large_is_refused_alone(
    kafka_bootstrap: str,  # noqa: F811
    log: KafkaLog,
) -> None:
    topic, key = await small_topic(kafka_bootstrap, log), "one-conversation"
    await log.append(topic, key, b"metadata")
    produces = Produces(log)
    # Given, in one cycle on one partition: six records that together are over the limit,
    # and one that is over it alone
    fitting = [bytes([65 + i]) * 3_000 for i in range(6)]
    too_large = b"z" * (TOPIC_LIMIT + 1)
    results = await asyncio.gather(
        *(log.append(topic, key, value) for value in fitting[:3]),
        log.append(topic, key, too_large),
        *(log.append(topic, key, value) for value in fitting[3:]),
        return_exceptions=True,
    )
    refused = results.pop(3)
    # Then the large one is refused alone, before it is sent (a size the broker refuses would
    # break the idempotent producer's sequence for the partition), the others are all written,
    # in batches the broker took (each under the topic's limit: 4 records of 3,000 bytes are not)
    assert isinstance(refused, RecordRefused) and "is over what" in str(refused) and produces.singles == 0
    assert all(isinstance(r, tuple) for r in results) and len(produces.batches) >= 2
    on_log = {r.offset: r.value for r in await read_topic(kafka_bootstrap, topic) if r.key == key.encode()}
    assert [on_log[offset] for _, offset in results] == fitting  # type: ignore[misc]
    assert too_large not in on_log.values()


async def test_at_the_limit_a_record_is_written_one_byte_over_it_is_refused_and_the_partition_goes_on(
    kafka_bootstrap: str,  # noqa: F811
    log: KafkaLog,
) -> None:
    topic, key = await small_topic(kafka_bootstrap, log), "one-conversation"
    await log.append(topic, key, b"metadata")
    largest = log.max_value_bytes(topic, key)
    at_limit = await log.append(topic, key, b"a" * largest)
    with pytest.raises(RecordRefused):
        await log.append(topic, key, b"b" * (largest + 1))
    after = await log.append(topic, key, b"after")  # the partition's appends go on
    on_log = {r.offset: r.value for r in await read_topic(kafka_bootstrap, topic) if r.key == key.encode()}
    assert on_log[at_limit[1]] == b"a" * largest and on_log[after[1]] == b"after"
    assert len(on_log) == 3


async def test_a_limit_lowered_while_the_log_runs_stops_the_worker_rather_than_leave_a_partition_refusing(
    kafka_bootstrap: str,  # noqa: F811
    log: KafkaLog,
) -> None:
    # Given a log that read the topic's limit at start, then an operator who lowers it
    topic, key = await small_topic(kafka_bootstrap, log), "one-conversation"
    await log.append(topic, key, b"metadata")
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:
        lowered = ConfigResource(ConfigResourceType.TOPIC, topic, configs={"max.message.bytes": "2000"})
        await admin.alter_configs([lowered])
    finally:
        await admin.close()
    # When a record between the two limits goes: the broker refuses it, and the idempotent
    # producer's sequence of the partition is broken for every record after it
    deadline = asyncio.get_running_loop().time() + 30
    while True:  # (the broker applies the new limit within moments)
        try:
            await log.append(topic, key, b"m" * 5_000)
        except RecordRefused:
            break
        assert asyncio.get_running_loop().time() < deadline, "the lowered limit was never applied"
    with pytest.raises(Exception):  # noqa: B017  (what aiokafka raises is its own)
        await log.append(topic, key, b"small")
    # Then the log stops its consumer loop, saying why, instead of running on
    with pytest.raises(ProducerBroken, match=r"a topic.s max\.message\.bytes was lowered while the worker ran"):
        await log.poll(0.01)


async def test_the_publisher_refuses_a_message_its_topic_would_and_the_partition_goes_on(
    kafka_bootstrap: str,  # noqa: F811
) -> None:
    # Given a service publishing with the documented KafkaPublisher to a topic of 10,000 bytes
    topic = await new_topic(kafka_bootstrap, **{"max.message.bytes": str(TOPIC_LIMIT)})
    async with KafkaPublisher(kafka_bootstrap, Topics(topic)) as publisher:
        # When one message is over the topic's limit, then it is refused before it is sent
        with pytest.raises(RecordRefused, match="is over what"):
            await publisher.publish(message_event("c1", "x" * 20_000, 1, "m-big"))
        # and the conversation's next messages are written (a broker refusal would have broken
        # the idempotent producer's sequence of the partition for every one after it)
        first = await publisher.publish(message_event("c1", "hello", 2, "m-1"))
        second = await publisher.publish(message_event("c1", "again", 3, "m-2"))
    assert second == (first[0], first[1] + 1)
