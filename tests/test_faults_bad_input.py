"""Scenario 5 on the real broker: hostile values on the events topic. Each goes to the DLQ
with its original bytes, partition, offset and a reason; the partition keeps moving (the
message after them is answered); the accepted state is what the valid events make.
The verdict is read from the topics with an independent consumer."""

from __future__ import annotations

import asyncio
import uuid

import orjson
import pytest
from fault_audit import check_invariants, counts, dead_letters, record, until_settled
from kafka_fixtures import fresh_topics, kafka_bootstrap  # noqa: F401  (fixtures)

from turnstile.events import MessageReceived, TurnCompleted, encode
from turnstile.handlers.claim import DebouncePolicy
from turnstile.handlers.providers.scripted import ScriptedProvider
from turnstile.streams.kafka_log import KafkaLog
from turnstile.streams.kafka_reader import partition_count
from turnstile.streams.log import Topics, partition_for
from turnstile.streams.publisher import message_event
from turnstile.streams.runtime import SystemClock
from turnstile.streams.worker import Worker, WorkerConfig

pytestmark = pytest.mark.kafka
NOW = SystemClock().now_ms
LIMIT = 10_000  # the worker's configured value limit in this test
CONV = "conv-bad"


def hostile_values() -> list[tuple[str, bytes, str]]:
    """(what, value, expected reason), every one keyed by CONV."""
    valid = encode(message_event(CONV, "a fine message", NOW(), "m-x"))
    unknown = orjson.loads(valid) | {"type": "MessageDeleted"}
    wrong_types = orjson.loads(valid) | {"occurred_at": "yesterday", "content": 42}
    huge = encode(message_event(CONV, "x" * (3 * LIMIT), NOW(), "m-huge"))
    other = encode(message_event("conv-other", "hello from elsewhere", NOW(), "m-other"))
    reused = encode(message_event(CONV, "hello, but different", NOW(), "m1"))
    return [
        ("truncated JSON", valid[: len(valid) // 2], "not_json"),
        ("valid JSON of an unknown type", orjson.dumps(unknown), "invalid_event"),
        ("a known type with wrong field types", orjson.dumps(wrong_types), "invalid_event"),
        ("a value over the configured limit", huge, "too_large"),
        ("a key that is not its conversation", other, "key_mismatch"),
        ("a message id reused for other content", reused, "conflicting_duplicate"),
    ]


async def test_hostile_values_are_dead_lettered_with_their_bytes_and_the_partition_keeps_moving(
    kafka_bootstrap: str, fresh_topics: Topics  # noqa: F811
) -> None:
    group = f"g-{uuid.uuid4().hex[:8]}"
    config = WorkerConfig(
        debounce=DebouncePolicy(quiet_ms=100, max_wait_ms=300), max_value_bytes=LIMIT, commit_interval_s=0.1
    )
    publisher = KafkaLog(kafka_bootstrap, group, fresh_topics)
    await publisher.producer.start()
    worker = Worker(KafkaLog(kafka_bootstrap, group, fresh_topics), ScriptedProvider(), config)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        first = message_event(CONV, "hello", NOW(), "m1")
        await publisher.append(fresh_topics.events, CONV, encode(first))
        written = []
        for what, value, reason in hostile_values():
            partition, offset = await publisher.append(fresh_topics.events, CONV, value)
            written.append((what, value, reason, partition, offset))
        # A valid message outside its conversation's partition (a producer whose partitioner
        # is not murmur2): folded there, the conversation would have two homes.
        stray = encode(message_event(CONV, "from the wrong partitioner", NOW(), "m-stray"))
        home = partition_for(CONV, await partition_count(kafka_bootstrap, fresh_topics.events))
        partition, offset = await publisher.append(fresh_topics.events, CONV, stray, partition=(home + 1) % 8)
        written.append(("a record outside its conversation's partition", stray, "wrong_partition", partition, offset))
        last = message_event(CONV, "and one more", NOW(), "m2")
        await publisher.append(fresh_topics.events, CONV, encode(last))

        def alive() -> None:
            assert not task.done(), "the worker stopped"

        audit = await until_settled(kafka_bootstrap, fresh_topics, ["m1", "m2"], 90, alive, max_bytes=LIMIT)
        deadline = asyncio.get_running_loop().time() + 60
        while len(letters := await dead_letters(kafka_bootstrap, fresh_topics)) < len(written):
            assert asyncio.get_running_loop().time() < deadline, f"only {len(letters)} dead letters"
            await asyncio.sleep(0.5)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        await publisher.producer.stop()

    check_invariants(audit)
    # One letter per bad value, naming where it sits. A letter whose first write failed is
    # retried while later ones go out, so the DLQ's order is not the events topic's.
    assert sorted((d.partition, d.offset, d.reason) for d in letters) == sorted((p, o, r) for _, _, r, p, o in written)
    at = {(d.partition, d.offset): d for d in letters}
    for what, value, _reason, partition, offset in written:
        letter = at[(partition, offset)]
        assert letter.original_value() == value, what
        assert letter.topic == fresh_topics.events and letter.key == CONV and letter.detail, what
    # Accepted state: exactly the two valid messages, m1 with its first content.
    state = audit.states[CONV]
    assert set(state.seen_inputs) == {"m1", "m2"}
    user_lines = [h.content for h in state.history if h.role == "user"]
    assert user_lines == ["hello", "and one more"]
    assert "conv-other" not in audit.states
    assert all(isinstance(e, MessageReceived) is False or e.message_id in {"m1", "m2"} for e in audit.raw())
    assert len(audit.of_type(TurnCompleted)) >= 1
    # The worker folded the same state the independent reader did.
    assert worker.states[CONV] == state
    result = record(counts("5. hostile values on the events topic", audit, len(letters), ["m1", "m2"]))
    assert (result.answered, result.answered_twice, result.lost, result.dlq) == (2, 0, 0, 7)
