"""Reading a topic whole, independent of any consumer group: for `tail`, audits and tests
that must judge the log itself rather than a worker's memory."""

from __future__ import annotations

import asyncio
import contextlib

from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError

from streams.log import Record, Topics


async def read_topic(bootstrap: str, topic: str, timeout_s: float = 30.0) -> list[Record]:
    """Every record of `topic` up to its end at the time of the call, in partition order."""
    # No group: the consumer subscribes and is given every partition of the topic. The
    # reset policy must be "earliest": the fetcher resets new partitions by it on its own,
    # and a "latest" reset racing our seek would silently skip the whole topic.
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        isolation_level="read_committed",
    )
    await consumer.start()
    try:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not (partitions := sorted(consumer.assignment())):
            if asyncio.get_running_loop().time() > deadline:
                raise LookupError(f"topic {topic!r} has no partitions on {bootstrap}")
            await asyncio.sleep(0.05)
        await consumer.seek_to_beginning(*partitions)
        ends = await consumer.end_offsets(partitions)
        out: list[Record] = []
        remaining = {tp for tp in partitions if ends[tp] > 0}
        deadline = asyncio.get_running_loop().time() + timeout_s
        while remaining:
            batch = await consumer.getmany(*remaining, timeout_ms=200)
            if not batch and asyncio.get_running_loop().time() > deadline:
                state = {tp.partition: (await consumer.position(tp), ends[tp]) for tp in remaining}
                raise TimeoutError(f"partitions of {topic} not read to the end: (position, end) {state}")
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
        forever = {"retention.ms": "-1"}  # the events are the source of truth; dead letters the only copy
        wanted = [
            NewTopic(topics.events, partitions, 1, topic_configs=forever),
            NewTopic(topics.outcomes, partitions, 1),
            NewTopic(topics.dead_letters, 1, 1, topic_configs=forever),
        ]
        existing = set(await admin.list_topics())
        missing = [t for t in wanted if t.name not in existing]
        if missing:
            with contextlib.suppress(TopicAlreadyExistsError):  # another process created them first
                await admin.create_topics(missing)
        await _until_led(admin, [t.name for t in wanted])
    finally:
        await admin.close()


async def _until_led(admin: AIOKafkaAdminClient, names: list[str], timeout_s: float = 15.0) -> None:
    """A created topic takes a moment to have leaders; clients that start sooner see no
    partitions or get NotLeader errors."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        described = await admin.describe_topics(names)
        if len(described) == len(names) and all(
            t["error_code"] == 0 and t["partitions"] and all(p["leader"] >= 0 for p in t["partitions"])
            for t in described
        ):
            return
        if loop.time() > deadline:
            raise TimeoutError(f"topics {names} have no leaders after {timeout_s}s")
        await asyncio.sleep(0.1)
