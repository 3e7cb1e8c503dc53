"""Reading a topic whole, independent of any consumer group: for `tail`, audits and tests
that must judge the log itself rather than a worker's memory."""

from __future__ import annotations

import contextlib

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError

from streams.log import Record, Topics


async def read_topic(bootstrap: str, topic: str, idle_timeout_s: float = 2.0) -> list[Record]:
    """Every record of `topic` up to its end at the time of the call, in partition order."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, isolation_level="read_committed")
    await consumer.start()
    try:
        partitions = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
        if not partitions:
            await consumer.topics()  # metadata of a topic we have not asked about yet
            partitions = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        ends = await consumer.end_offsets(partitions)
        out: list[Record] = []
        remaining = {tp for tp in partitions if ends[tp] > 0}
        while remaining:
            batch = await consumer.getmany(*remaining, timeout_ms=int(idle_timeout_s * 1000))
            if not batch:
                raise TimeoutError(f"no records from {sorted(tp.partition for tp in remaining)} of {topic}")
            for tp, messages in batch.items():
                out.extend(Record(tp.partition, m.offset, m.key, m.value) for m in messages if m.offset < ends[tp])
                if await consumer.position(tp) >= ends[tp]:
                    remaining.discard(tp)
        return sorted(out, key=lambda r: (r.partition, r.offset))
    finally:
        await consumer.stop()


async def ensure_topics(bootstrap: str, topics: Topics, partitions: int) -> None:
    """Create the three topics if they are missing (the infra script does the same)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        wanted = [
            NewTopic(topics.events, partitions, 1),
            NewTopic(topics.outcomes, partitions, 1),
            NewTopic(topics.dead_letters, 1, 1),
        ]
        existing = set(await admin.list_topics())
        missing = [t for t in wanted if t.name not in existing]
        if missing:
            with contextlib.suppress(TopicAlreadyExistsError):  # another process created them first
                await admin.create_topics(missing)
    finally:
        await admin.close()
