"""On the real broker: 50 conversations, some with a slow model, two workers in one
group (the second joins mid-run, forcing a rebalance). The verdict comes from reading the
topic with an independent consumer, not from the workers' memory."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter

import pytest
from kafka_fixtures import fresh_topics, kafka_bootstrap  # noqa: F401  (fixtures)

from turnstile.events import OUTCOME_TYPES, DecodeError, MessageReceived, TurnClaimed, decode
from turnstile.handlers.claim import DebouncePolicy
from turnstile.handlers.provider import ModelRequest
from turnstile.handlers.providers.scripted import Scripted, ScriptedProvider, echo_reply
from turnstile.streams.kafka_log import KafkaLog
from turnstile.streams.kafka_reader import read_topic
from turnstile.streams.log import Topics
from turnstile.streams.publisher import message_event, publish
from turnstile.streams.runtime import SystemClock
from turnstile.streams.turn_runner import TurnSettings
from turnstile.streams.worker import Worker, WorkerConfig

pytestmark = pytest.mark.kafka
CONVERSATIONS = 50
NOW = SystemClock().now_ms


def slow_for_some(request: ModelRequest) -> Scripted:
    return Scripted(echo_reply(request), delay_s=2.0 if "[slow]" in request.messages[-1].content else 0.05)


async def log_events(bootstrap: str, topics: Topics):
    return [e for r in await read_topic(bootstrap, topics.events) if not isinstance(e := decode(r.value), DecodeError)]


async def test_fifty_conversations_two_workers_every_message_claimed_once_every_turn_one_outcome(
    kafka_bootstrap: str, fresh_topics: Topics  # noqa: F811
):
    group = f"g-{uuid.uuid4().hex[:8]}"
    config = WorkerConfig(debounce=DebouncePolicy(quiet_ms=200, max_wait_ms=600), turn=TurnSettings())
    publisher = KafkaLog(kafka_bootstrap, group, fresh_topics)
    await publisher.producer.start()
    stop = asyncio.Event()
    workers = []

    def start_worker() -> asyncio.Task[None]:
        worker = Worker(KafkaLog(kafka_bootstrap, group, fresh_topics), ScriptedProvider(slow_for_some), config)
        workers.append(worker)
        return asyncio.create_task(worker.run(stop))

    tasks = [start_worker()]
    sent: list[str] = []
    try:
        for round_ in range(2):  # the second message of a conversation often lands mid-turn
            for i in range(CONVERSATIONS):
                text = f"question {round_} of conversation {i}" + (" [slow]" if i % 5 == 0 else "")
                event = message_event(f"conv-{i}", text, NOW(), f"c{i}-m{round_}")
                await publish(publisher, event)
                sent.append(event.message_id)
            if round_ == 0:
                await asyncio.sleep(0.5)
                tasks.append(start_worker())  # joins mid-run: a rebalance while turns are in flight
                await asyncio.sleep(0.5)

        deadline = asyncio.get_running_loop().time() + 90
        while True:
            events = await log_events(kafka_bootstrap, fresh_topics)
            claimed = Counter(i for e in events if isinstance(e, TurnClaimed) for i in e.input_ids)
            outcomes = Counter(e.turn_id for e in events if isinstance(e, OUTCOME_TYPES))
            claims = {e.turn_id for e in events if isinstance(e, TurnClaimed)}
            if set(claimed) == set(sent) and claims == set(outcomes):
                break
            assert asyncio.get_running_loop().time() < deadline, (
                f"{len(set(sent) - set(claimed))} messages unclaimed, {len(claims - set(outcomes))} turns open"
            )
            await asyncio.sleep(1.0)
    finally:
        stop.set()
        await asyncio.gather(*tasks)
        await publisher.producer.stop()

    published = [e.message_id for e in events if isinstance(e, MessageReceived)]
    assert sorted(published) == sorted(sent)
    assert all(n == 1 for n in claimed.values()), [m for m, n in claimed.items() if n > 1]
    assert all(n == 1 for n in outcomes.values()), [t for t, n in outcomes.items() if n > 1]
    replies = Counter((e.conversation_id, e.reply) for e in events if e.type == "TurnCompleted")
    assert all(n == 1 for n in replies.values())
    # Both workers ran turns: the partitions were really shared.
    by_partition = {p for w in workers for p in w.partition_liveness()}
    assert len(by_partition) == 8
    outcome_records = await read_topic(kafka_bootstrap, fresh_topics.outcomes)
    assert {decode(r.value).turn_id for r in outcome_records} == set(outcomes)


async def test_a_worker_restarted_in_the_same_group_rebuilds_state_from_offset_zero(
    kafka_bootstrap: str, fresh_topics: Topics  # noqa: F811
):
    """Committed offsets mark effects already done; they must not make a new owner skip
    the history it needs. The second worker's state equals the first's."""
    group = f"g-{uuid.uuid4().hex[:8]}"
    config = WorkerConfig(debounce=DebouncePolicy(quiet_ms=50, max_wait_ms=100), commit_interval_s=0.1)
    first = Worker(KafkaLog(kafka_bootstrap, group, fresh_topics), ScriptedProvider(), config)
    stop = asyncio.Event()
    task = asyncio.create_task(first.run(stop))
    for i in range(5):
        await publish(first.log, message_event(f"conv-{i}", f"question {i}", NOW(), f"m{i}"))
    deadline = asyncio.get_running_loop().time() + 60
    while sum(len(s.turns) for s in first.states.values()) < 5:
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.1)
    await asyncio.sleep(0.5)  # let a commit happen
    before = dict(first.states)
    stop.set()
    await task

    second = Worker(KafkaLog(kafka_bootstrap, group, fresh_topics), ScriptedProvider(), config)
    stop = asyncio.Event()
    task = asyncio.create_task(second.run(stop))
    try:
        while not (
            (live := second.partition_liveness()) and all(live.values()) and second.states_local
            and all(map(second.state_of, before))
        ):
            assert asyncio.get_running_loop().time() < deadline + 60
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)
        # in memory, or (settled, from its snapshot) in the local store
        assert {c: second.state_of(c) for c in before} == before
    finally:
        stop.set()
        await task
    events = await log_events(kafka_bootstrap, fresh_topics)
    assert sum(isinstance(e, TurnClaimed) for e in events) == 5
    outcome_records = await read_topic(kafka_bootstrap, fresh_topics.outcomes)
    assert len(outcome_records) == 5  # not published again by the second owner
