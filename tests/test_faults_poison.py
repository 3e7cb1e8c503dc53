"""On the real broker, two workers in one group: values of every hostile class, up to just
under the broker's max message size, interleaved with good messages. Every good message is
answered once, every bad value is on the DLQ once (in a letter that fits the DLQ topic),
neither worker exits, the group's lag returns to 0, and a restart writes no dead letter twice.
The verdict is read from the topics and the group's committed offsets, not from the workers."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import uuid
from collections import Counter

import orjson
import pytest
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaConnectionError
from fault_audit import check_invariants, counts, dead_letters, record, until_settled
from kafka_fixtures import fresh_topics, kafka_bootstrap  # noqa: F401  (fixtures)

from turnstile.events import encode
from turnstile.handlers.claim import DebouncePolicy
from turnstile.handlers.providers.scripted import ScriptedProvider
from turnstile.projections.audit import Auditor
from turnstile.streams.kafka_log import KafkaLog, topic_max_message_bytes
from turnstile.streams.kafka_reader import group_less_consumer, read_topic
from turnstile.streams.log import Topics
from turnstile.streams.publisher import message_event
from turnstile.streams.runtime import SystemClock
from turnstile.streams.snapshots import SnapshotPolicy
from turnstile.streams.worker import Worker, WorkerConfig

pytestmark = pytest.mark.kafka
NOW = SystemClock().now_ms
CONFIG = WorkerConfig(debounce=DebouncePolicy(quiet_ms=50, max_wait_ms=200), commit_interval_s=0.1)
GOOD_CONVERSATIONS = 12


def hostile_values(max_message: int) -> list[tuple[str, str | None, bytes]]:
    """(what, key, value): every class the worker must dead-letter and move past."""
    valid = encode(message_event("bad-0", "fine", NOW(), "bad-m0"))
    near = max_message - 400  # what the broker still accepts, with the record's overhead
    return [
        ("truncated JSON", "bad-0", valid[: len(valid) // 2]),
        ("unknown type", "bad-0", orjson.dumps(orjson.loads(valid) | {"type": "MessageDeleted"})),
        ("wrong key", "bad-1", valid),
        ("missing fields", "bad-0", orjson.dumps({"type": "MessageReceived", "conversation_id": "bad-0"})),
        ("invalid UTF-8", "bad-2", b"\xff\xfe\x00 not text \xc3\x28"),
        ("empty value", "bad-3", b""),
        ("null key", None, valid),
        ("not-an-object JSON", "bad-4", b"[1, 2, 3]"),
        ("a JSON string", "bad-4", b'"hello"'),
        ("100,000-deep nesting", "bad-5", b"[" * 100_000 + b"]" * 100_000),
        ("100,000-deep objects", "bad-5", b'{"a":' * 100_000 + b"1" + b"}" * 100_000),
        ("just under the max, truncated JSON", "bad-6", b'{"type":"MessageReceived","content":"'.ljust(near, b"x")),
        ("just under the max, binary", "bad-7", bytes(range(256)) * (near // 256)),
        ("just under the max, not UTF-8 JSON", "bad-8", b'{"a":"' + b"\xff" * (near - 8) + b'"}'),
    ]


async def group_lag(bootstrap: str, group: str, topic: str) -> int:
    """End offsets minus the group's committed offsets, summed over the topic's partitions."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        committed = await admin.list_consumer_group_offsets(group)
    finally:
        await admin.close()
    async with group_less_consumer(bootstrap, topic) as (consumer, partitions):
        ends = await consumer.end_offsets(partitions)
    return sum(end - (committed[tp].offset if tp in committed else 0) for tp, end in ends.items())


async def until(condition, timeout_s: float, what: str, alive) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await condition():
        alive()
        assert asyncio.get_running_loop().time() < deadline, f"not within {timeout_s}s: {what}"
        await asyncio.sleep(0.5)


async def test_hostile_values_of_every_class_never_stop_two_workers(
    kafka_bootstrap: str, fresh_topics: Topics  # noqa: F811
) -> None:
    group = f"g-{uuid.uuid4().hex[:8]}"
    limits = await topic_max_message_bytes(kafka_bootstrap, [fresh_topics.events, fresh_topics.dead_letters])
    publisher = KafkaLog(kafka_bootstrap, group, fresh_topics)
    await publisher.producer.start()
    stop = asyncio.Event()
    workers = [Worker(KafkaLog(kafka_bootstrap, group, fresh_topics), ScriptedProvider(), CONFIG) for _ in range(2)]
    tasks = [asyncio.create_task(worker.run(stop)) for worker in workers]

    def alive() -> None:
        assert not any(t.done() for t in tasks), "a worker stopped"

    good: list[str] = []
    bad: dict[tuple[int, int], tuple[str, str | None, bytes]] = {}
    try:
        hostile = hostile_values(limits[fresh_topics.events])
        for i in range(max(GOOD_CONVERSATIONS, len(hostile))):
            if i < GOOD_CONVERSATIONS:
                event = message_event(f"good-{i}", f"question {i}", NOW(), f"good-m{i}")
                await publisher.append(fresh_topics.events, event.conversation_id, encode(event))
                good.append(event.message_id)
            if i < len(hostile):
                what, key, value = hostile[i]
                where = await publisher.append(fresh_topics.events, key, value)
                bad[where] = hostile[i]

        audit = await until_settled(kafka_bootstrap, fresh_topics, good, 120, alive, max_bytes=None)
        check_invariants(audit)

        async def all_dead_lettered() -> bool:
            return len(await dead_letters(kafka_bootstrap, fresh_topics)) >= len(bad)

        await until(all_dead_lettered, 60, "every bad value on the DLQ", alive)

        async def no_lag() -> bool:
            return await group_lag(kafka_bootstrap, group, fresh_topics.events) == 0

        await until(no_lag, 60, "the group's lag back to 0", alive)
        alive()
    finally:
        stop.set()
        await asyncio.gather(*(asyncio.wait_for(t, 60) for t in tasks), return_exceptions=True)
    for task in tasks:
        assert task.exception() is None

    result = record(counts("poison pills, two workers", audit, len(bad), good))
    assert (result.answered, result.answered_twice, result.lost) == (len(good), 0, 0)
    dlq_records = await read_topic(kafka_bootstrap, fresh_topics.dead_letters)
    letters = await dead_letters(kafka_bootstrap, fresh_topics)
    assert Counter((letter.partition, letter.offset) for letter in letters) == Counter(set(bad))  # each once
    for raw, letter in zip(dlq_records, letters, strict=True):
        what, key, value = bad[(letter.partition, letter.offset)]
        assert len(raw.value or b"") <= limits[fresh_topics.dead_letters]
        assert letter.value_bytes == len(value) and letter.value_sha256 == hashlib.sha256(value).hexdigest(), what
        assert value.startswith(letter.original_value()), what
        assert letter.value_truncated == (len(value) > 700_000), what  # base64 takes 4/3
        assert raw.key == (None if key is None else key.encode()), what  # a null key stays null
    events = await read_topic(kafka_bootstrap, fresh_topics.events)
    report = Auditor().feed_all(events).feed_dead_letters(letters).report()
    assert report.ok and not report.not_dead_lettered  # the auditor names each letter, where it is
    assert sorted((f.partition, f.offset) for f in report.dead_letters) == sorted(bad)

    # A restart of the group that replays it all (no snapshots, which would skip what they
    # cover): nothing before its committed offsets is dead-lettered again.
    again = asyncio.Event()
    full_replay = dataclasses.replace(CONFIG, snapshots=SnapshotPolicy(enabled=False))
    worker = Worker(KafkaLog(kafka_bootstrap, group, fresh_topics), ScriptedProvider(), full_replay)
    task = asyncio.create_task(worker.run(again))
    try:
        late = message_event("good-late", "one more", NOW(), "good-late")
        await publisher.append(fresh_topics.events, late.conversation_id, encode(late))
        await until_settled(kafka_bootstrap, fresh_topics, [*good, "good-late"], 60, lambda: None, max_bytes=None)
        assert not task.done()
    finally:
        again.set()
        await asyncio.wait_for(task, 60)
        await publisher.stop()
    assert len(await dead_letters(kafka_bootstrap, fresh_topics)) == len(bad)
    assert worker.dead_letters == len(bad)  # it met them all on replay, and wrote none



class RefusingEffects(KafkaLog):
    """A producer that refuses every outcome record and dead letter while `down` is set, as
    during an outage of those topics' leaders; events still go through."""

    down = True
    refused = 0

    async def append(self, topic, key, value, partition=None, headers=None):  # type: ignore[no-untyped-def]
        if self.down and topic in (self.topics.outcomes, self.topics.dead_letters):
            self.refused += 1
            raise KafkaConnectionError("refused for the test")
        return await super().append(topic, key, value, partition, headers)


async def committed_offsets(bootstrap: str, group: str) -> dict[int, int]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        return {tp.partition: meta.offset for tp, meta in (await admin.list_consumer_group_offsets(group)).items()}
    finally:
        await admin.close()


async def test_effects_refused_for_a_while_are_retried_never_committed_past_and_caught_up(
    kafka_bootstrap: str, fresh_topics: Topics  # noqa: F811
) -> None:
    group = f"g-{uuid.uuid4().hex[:8]}"
    publisher = KafkaLog(kafka_bootstrap, group, fresh_topics)
    await publisher.producer.start()
    log = RefusingEffects(kafka_bootstrap, group, fresh_topics)
    worker = Worker(log, ScriptedProvider(), CONFIG)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))

    def alive() -> None:
        assert not task.done(), "the worker stopped"

    try:
        good = []
        first_effect: dict[int, int] = {}  # partition -> offset of its first bad value
        for i in range(6):
            event = message_event(f"c-{i}", f"question {i}", NOW(), f"m{i}")
            await publisher.append(fresh_topics.events, event.conversation_id, encode(event))
            good.append(event.message_id)
            p, o = await publisher.append(fresh_topics.events, f"c-{i}", b"not json")
            first_effect.setdefault(p, o)
        await until_settled(kafka_bootstrap, fresh_topics, good, 60, alive)  # turns go on meanwhile

        async def refused_often() -> bool:
            return log.refused >= 20

        await until(refused_often, 60, "the effects retried", alive)
        committed = await committed_offsets(kafka_bootstrap, group)
        assert all(committed.get(p, 0) <= o for p, o in first_effect.items()), (committed, first_effect)
        assert await read_topic(kafka_bootstrap, fresh_topics.outcomes) == []
        log.down = False

        async def caught_up() -> bool:
            return len(await dead_letters(kafka_bootstrap, fresh_topics)) == 6 and (
                await group_lag(kafka_bootstrap, group, fresh_topics.events) == 0
            )

        await until(caught_up, 60, "the effects written and committed past", alive)
        assert len(await read_topic(kafka_bootstrap, fresh_topics.outcomes)) == 6
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
        await publisher.stop()
