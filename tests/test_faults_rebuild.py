"""Scenario 7 on the real broker: a worker restarted with empty local state (a new process
has no table and no cache; only the group's committed offsets survive, in Kafka) rebuilds
every conversation from offset 0. The rebuilt projections equal the ones before and the
ones an independent reader folds, and no one-time effect is repeated: no new event, no
outcome record and no dead letter written twice."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from fault_audit import audit_log, check_invariants, counts, dead_letters, record, until, until_settled
from kafka_fixtures import fresh_topics, kafka_bootstrap  # noqa: F401  (fixtures)

from turnstile.events import OUTCOME_TYPES
from turnstile.handlers.claim import DebouncePolicy
from turnstile.handlers.providers.scripted import ScriptedProvider
from turnstile.streams.kafka_log import KafkaLog
from turnstile.streams.kafka_reader import read_topic
from turnstile.streams.log import Topics
from turnstile.streams.publisher import message_event, publish
from turnstile.streams.runtime import SystemClock
from turnstile.streams.worker import Worker, WorkerConfig

pytestmark = pytest.mark.kafka
NOW = SystemClock().now_ms
CONVERSATIONS = 12


async def test_a_worker_with_empty_state_rebuilds_equal_projections_and_repeats_no_effect(
    kafka_bootstrap: str, fresh_topics: Topics  # noqa: F811
) -> None:
    group = f"g-{uuid.uuid4().hex[:8]}"
    config = WorkerConfig(debounce=DebouncePolicy(quiet_ms=50, max_wait_ms=200), commit_interval_s=0.1)
    publisher = KafkaLog(kafka_bootstrap, group, fresh_topics)
    await publisher.producer.start()
    sent = []
    first = Worker(KafkaLog(kafka_bootstrap, group, fresh_topics), ScriptedProvider(), config)
    stop = asyncio.Event()
    task = asyncio.create_task(first.run(stop))
    try:
        for round_ in range(2):
            for i in range(CONVERSATIONS):
                event = message_event(f"conv-{i}", f"question {round_} of {i}", NOW(), f"c{i}-m{round_}")
                await publish(publisher, event)
                sent.append(event.message_id)
        await publisher.append(fresh_topics.events, "conv-0", b'{"type": "MessageReceived", "trunc')
        await publisher.append(fresh_topics.events, "conv-1", b'{"type": "NoSuchEvent"}')

        def alive() -> None:
            assert not task.done(), "the worker stopped"

        audit = await until_settled(kafka_bootstrap, fresh_topics, sent, 120, alive)
        await until(lambda: first.dead_letters == 2, 60, "the dead letters")
        # Everything written is folded back (no runner left) before the snapshot.
        await until(lambda: not first.runners and not first._dirty, 60, "the first worker to go idle")
        await asyncio.sleep(1.0)  # a commit interval or more: offsets committed
        before = dict(first.states)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        await publisher.producer.stop()
    events_before = len(await read_topic(kafka_bootstrap, fresh_topics.events))
    outcomes_before = len(await read_topic(kafka_bootstrap, fresh_topics.outcomes))
    letters_before = len(await dead_letters(kafka_bootstrap, fresh_topics))
    assert (outcomes_before, letters_before) == (len(audit.of_type(OUTCOME_TYPES)), 2)

    # A new worker object in the same group: nothing in memory, the log is all it has.
    second = Worker(KafkaLog(kafka_bootstrap, group, fresh_topics), ScriptedProvider(), config)
    stop = asyncio.Event()
    task = asyncio.create_task(second.run(stop))
    try:
        await until(
            lambda: bool(second.partition_liveness())
            and all(second.partition_liveness().values())
            and second.states_local
            and all(second.state_of(c) is not None for c in before),
            90,
            "the rebuild",
        )
        await asyncio.sleep(1.0)  # room for any (wrong) decision to be written
        # in memory, or (settled, from its snapshot) in the local store
        assert {c: second.state_of(c) for c in before} == before
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)

    after = await audit_log(kafka_bootstrap, fresh_topics)
    check_invariants(after)
    assert after.states == before  # the independent reader folds the same projections
    assert len(after.records) == events_before  # the rebuild wrote nothing
    assert len(await read_topic(kafka_bootstrap, fresh_topics.outcomes)) == outcomes_before
    letters = await dead_letters(kafka_bootstrap, fresh_topics)
    assert len(letters) == letters_before == 2
    result = record(counts("7. restart from empty local state", after, len(letters), sent))
    assert (result.answered, result.answered_twice, result.lost, result.dlq) == (len(sent), 0, 0, 2)
