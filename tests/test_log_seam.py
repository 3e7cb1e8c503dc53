"""The log seam: both logs answer partitioning, end offsets, a producer-only open and a
reader in no group the same way, so nothing above it needs to know which one it has."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid

import pytest
from kafka_fixtures import fresh_topics, kafka_bootstrap  # noqa: F401  (fixtures)

from turnstile.events import decode
from turnstile.streams.file_log import FileLog
from turnstile.streams.kafka_log import KafkaLog
from turnstile.streams.log import EventLog, LogOwned, Topics, partition_for
from turnstile.streams.publisher import message_event, publish
from turnstile.streams.runtime import SystemClock

NOW = SystemClock().now_ms
CONVERSATIONS = [f"c{i}" for i in range(12)]


async def publish_all(log: EventLog) -> dict[str, int]:
    """One message per conversation; where each landed."""
    landed = {}
    for c in CONVERSATIONS:
        landed[c], _offset = await publish(log, message_event(c, f"hello {c}", NOW(), f"m-{c}"))
    return landed


def conversations_of(records: list) -> set[str]:
    return {decode(r.value).conversation_id for r in records}


async def test_the_embedded_log_partitions_like_kafka_and_reads_one_conversation(tmp_path):
    log = FileLog(tmp_path, partitions=3)
    await log.start_producer()
    landed = await publish_all(log)
    assert log.partition_count() == 3
    assert landed == {c: log.partition_for(c) for c in CONVERSATIONS} == {c: partition_for(c, 3) for c in CONVERSATIONS}
    assert sum(log.end_offset(p) for p in range(3)) == len(CONVERSATIONS)

    reader = log.reader()
    assert conversations_of(await reader.read(log.topics.events)) == set(CONVERSATIONS)
    neighbours = {c for c in CONVERSATIONS if landed[c] == landed["c1"]}
    assert conversations_of(await reader.conversation("c1")) == neighbours


async def test_a_publisher_of_the_embedded_log_owns_nothing(tmp_path):
    owner, publisher = FileLog(tmp_path), FileLog(tmp_path)
    owner.own()
    try:
        await publisher.start_producer()  # beside the owner: appends, folds nothing
        await publish(publisher, message_event("c1", "hi", NOW(), "m1"))
        with pytest.raises(LogOwned, match="pid"):
            FileLog(tmp_path).own()
    finally:
        await owner.stop()


async def test_following_the_embedded_log_starts_at_its_end(tmp_path):
    log = FileLog(tmp_path, partitions=1)
    await publish(log, message_event("old", "before", NOW(), "m0"))
    follow = log.reader().follow(log.topics.events, since_ms=0)
    first = asyncio.ensure_future(anext(follow))
    await asyncio.sleep(0)  # the follower positions itself at the end
    await publish(log, message_event("new", "after", NOW(), "m1"))
    record = await asyncio.wait_for(first, 10)
    assert decode(record.value).conversation_id == "new"
    await follow.aclose()


def test_metrics_and_the_scheduler_do_not_import_the_worker():
    # The worker reports to metrics and the scheduler asks the worker: neither needs it.
    code = (
        "import sys, turnstile.streams.metrics, turnstile.streams.scheduler;"
        "sys.exit('turnstile.streams.worker' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


@pytest.mark.kafka
async def test_kafka_producer_only_open_joins_no_group_and_partitions_like_the_broker(
    kafka_bootstrap: str,  # noqa: F811
    fresh_topics: Topics,  # noqa: F811
):
    from aiokafka.admin import AIOKafkaAdminClient

    group = f"never-joined-{uuid.uuid4().hex[:8]}"
    log = KafkaLog(kafka_bootstrap, group, fresh_topics)
    await log.start_producer()
    try:
        landed = await publish_all(log)
    finally:
        await log.stop()
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:
        groups = {g[0] for g in await admin.list_consumer_groups()}
    finally:
        await admin.close()
    assert group not in groups

    reader = log.reader()
    assert landed == {c: partition_for(c, 8) for c in CONVERSATIONS}  # the fixture's topics have 8
    neighbours = {c for c in CONVERSATIONS if landed[c] == landed["c1"]}
    assert conversations_of(await reader.conversation("c1")) == neighbours
    assert conversations_of(await reader.read(fresh_topics.events)) == set(CONVERSATIONS)
