"""Scenario 6 on the real broker: producers that misbehave.

* the same message published twice (the exact bytes again, and again under a new event id);
* messages of one conversation published out of their timestamp order: one turn renders
  them in timestamp order;
* a burst of 500 messages to one conversation, stamped within one second: bounded turns
  (`max_batch`), none lost, none twice;
* a transactional producer whose markers (and an aborted record) end the partition: the
  replay still reaches the end.

Plus the fold's side of "published twice" for turn events: an exact duplicate of a step
(same event id) is ignored, so it cannot count tokens or tool calls twice.
The verdict comes from folding the topic with an independent reader (fault_audit)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable

import pytest
from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from builders import claim, message, started
from fault_audit import LogAudit, check_invariants, counts, dead_letters, record, until, until_settled
from kafka_fixtures import fresh_topics, kafka_bootstrap  # noqa: F401  (fixtures)

from turnstile.events import ModelResponded, TurnClaimed, Usage, encode
from turnstile.events.identity import partition_for
from turnstile.handlers.claim import DebouncePolicy
from turnstile.handlers.providers.scripted import ScriptedProvider
from turnstile.projections import apply_event, new_state
from turnstile.streams.kafka_log import KafkaLog
from turnstile.streams.log import Topics
from turnstile.streams.publisher import message_event
from turnstile.streams.runtime import SystemClock
from turnstile.streams.worker import Worker, WorkerConfig

pytestmark = pytest.mark.kafka
NOW = SystemClock().now_ms
BURST = 500
MAX_BATCH = 20


async def run_until_settled(
    bootstrap: str,
    topics: Topics,
    config: WorkerConfig,
    send: Callable[[KafkaLog], Awaitable[None]],
    expected: list[str],
    timeout_s: float = 120,
) -> tuple[LogAudit, ScriptedProvider]:
    group = f"g-{uuid.uuid4().hex[:8]}"
    publisher = KafkaLog(bootstrap, group, topics)
    await publisher.producer.start()
    provider = ScriptedProvider()
    worker = Worker(KafkaLog(bootstrap, group, topics), provider, config)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        await send(publisher)

        def alive() -> None:
            assert not task.done(), "the worker stopped"

        audit = await until_settled(bootstrap, topics, expected, timeout_s, alive)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        await publisher.producer.stop()
    return audit, provider


async def test_duplicates_and_out_of_order_timestamps(kafka_bootstrap: str, fresh_topics: Topics) -> None:  # noqa: F811
    config = WorkerConfig(debounce=DebouncePolicy(quiet_ms=2000, max_wait_ms=4000), commit_interval_s=0.1)
    t = NOW()
    original = message_event("conv-dup", "check the dates", t, "d1")
    again = original.model_copy(update={"event_id": "another-event-id"})  # a producer's retry
    later = message_event("conv-order", "and then the refund rules", t, "o2")
    earlier = message_event("conv-order", "first the dates", t - 2000, "o1")

    async def send(publisher: KafkaLog) -> None:
        for event in (original, original, again):  # the exact bytes twice, then a new event id
            await publisher.append(fresh_topics.events, event.conversation_id, encode(event))
        for event in (later, earlier):  # published against their timestamp order
            await publisher.append(fresh_topics.events, event.conversation_id, encode(event))

    audit, provider = await run_until_settled(kafka_bootstrap, fresh_topics, config, send, ["d1", "o1", "o2"])
    check_invariants(audit)
    claims = {c.conversation_id: c.input_ids for c in audit.of_type(TurnClaimed)}
    assert claims == {"conv-dup": ("d1",), "conv-order": ("o1", "o2")}
    duplicates = [(e.conversation_id, r.reason) for _, e, r in audit.ignored]
    assert duplicates == [("conv-dup", "duplicate of input 'd1'")] * 2
    # One request per turn; the out-of-order pair is rendered in timestamp order.
    assert len(provider.requests) == 2
    [ordered] = [r for r in provider.requests if "first the dates" in r.messages[-1].content]
    text = ordered.messages[-1].content
    assert text.index("first the dates") < text.index("and then the refund rules")
    letters = await dead_letters(kafka_bootstrap, fresh_topics)
    result = record(counts("6a. duplicates + out-of-order timestamps", audit, len(letters), ["d1", "o1", "o2"]))
    assert (result.answered, result.answered_twice, result.lost, result.dlq) == (3, 0, 0, 0)


async def test_a_burst_of_500_messages_becomes_bounded_turns(kafka_bootstrap: str, fresh_topics: Topics) -> None:  # noqa: F811
    config = WorkerConfig(
        debounce=DebouncePolicy(quiet_ms=200, max_wait_ms=1000, max_batch=MAX_BATCH), commit_interval_s=0.2
    )
    t = NOW()
    burst = [message_event("conv-burst", f"message {i}", t + i, f"b{i:03d}") for i in range(BURST)]  # within 1 s
    sent = [e.message_id for e in burst]

    async def send(publisher: KafkaLog) -> None:
        # All in flight at once, as a chatty client would: the producer batches them.
        futures = [
            await publisher.producer.send(fresh_topics.events, value=encode(e), key=e.conversation_id.encode())
            for e in burst
        ]
        await asyncio.gather(*futures)

    audit, provider = await run_until_settled(kafka_bootstrap, fresh_topics, config, send, sent, timeout_s=180)
    check_invariants(audit)
    claims = audit.of_type(TurnClaimed)
    assert all(1 <= len(c.input_ids) <= MAX_BATCH for c in claims)
    assert len(claims) >= BURST // MAX_BATCH
    claimed = [i for c in claims for i in c.input_ids]
    assert sorted(claimed) == sorted(sent)  # none lost, none twice
    assert claimed == sent  # each turn takes the oldest pending, in timestamp order
    assert len(provider.requests) == len(claims)
    letters = await dead_letters(kafka_bootstrap, fresh_topics)
    result = record(counts(f"6b. burst of {BURST} messages in 1 s", audit, len(letters), sent))
    assert (result.answered, result.answered_twice, result.lost, result.dlq) == (BURST, 0, 0, 0)


def test_an_exact_duplicate_of_a_turn_event_is_ignored_by_the_fold() -> None:
    c = claim(["m1"], 10, 0)
    responded = ModelResponded(
        event_id="e-resp", conversation_id=c.conversation_id, occurred_at=12, turn_id=c.turn_id, run_id=c.run_id,
        attempt=1, iteration=1, model="m", text="hi", usage=Usage(input_tokens=100, output_tokens=7), cost_usd=0.25,
    )  # fmt: skip
    state = new_state(c.conversation_id)
    for event in (message("m1", 5), c, started(c, 11), responded):
        assert apply_event(state, event) is None
    turn = state.active
    assert turn is not None
    before = (turn.input_tokens, turn.output_tokens, turn.cost_usd, turn.iterations, state.events_applied)
    rejection = apply_event(state, responded)
    assert rejection is not None and not rejection.conflict and "duplicate" in rejection.reason
    assert (turn.input_tokens, turn.output_tokens, turn.cost_usd, turn.iterations, state.events_applied) == before


async def test_a_partition_ending_in_transaction_markers_replays_to_its_end_and_answers(
    kafka_bootstrap: str, fresh_topics: Topics  # noqa: F811
) -> None:
    # Given, before any worker runs: a message committed in a transaction, then one in an
    # aborted transaction. The partition's last offsets hold the commit marker, the aborted
    # record and the abort marker, none of which a read_committed consumer delivers.
    committed = message_event("conv-txn", "sent in a transaction", NOW(), "t1")
    aborted = message_event("conv-txn", "never committed", NOW(), "t2")
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, transactional_id=f"tx-{uuid.uuid4().hex[:8]}")
    await producer.start()
    try:
        async with producer.transaction():
            await producer.send_and_wait(fresh_topics.events, encode(committed), key=b"conv-txn")
        await producer.begin_transaction()
        await producer.send_and_wait(fresh_topics.events, encode(aborted), key=b"conv-txn")
        await producer.abort_transaction()
    finally:
        await producer.stop()

    async def nothing_more(_publisher: KafkaLog) -> None:
        return None

    # When a worker is assigned the partition, its replay reaches the partition's end (it
    # waited for a record that never came), and the committed message is answered
    config = WorkerConfig(debounce=DebouncePolicy(quiet_ms=0, max_wait_ms=0))
    audit, _ = await run_until_settled(kafka_bootstrap, fresh_topics, config, nothing_more, ["t1"], timeout_s=60)
    check_invariants(audit)
    assert [c.input_ids for c in audit.of_type(TurnClaimed)] == [("t1",)]  # the aborted one never


async def test_a_live_partition_whose_last_offsets_deliver_nothing_shows_no_lag_and_is_committed_to_its_end(
    kafka_bootstrap: str, fresh_topics: Topics  # noqa: F811
) -> None:
    # Given a live worker on an empty topic
    group = f"g-{uuid.uuid4().hex[:8]}"
    config = WorkerConfig(debounce=DebouncePolicy(quiet_ms=0, max_wait_ms=0), commit_interval_s=0.1)
    worker = Worker(KafkaLog(kafka_bootstrap, group, fresh_topics), ScriptedProvider(), config)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    partition = partition_for("conv-txn", 8)
    try:
        await until(lambda: partition in worker.consumer_lag(), 60, "the partition is live")
        # When a publisher aborts a transaction there: its record and the abort marker take
        # offsets 0 and 1, and a read_committed consumer delivers neither
        producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, transactional_id=f"tx-{uuid.uuid4().hex[:8]}")
        await producer.start()
        try:
            await producer.begin_transaction()
            await producer.send_and_wait(
                fresh_topics.events, encode(message_event("conv-txn", "never committed", NOW(), "t1")),
                key=b"conv-txn", partition=partition,
            )  # fmt: skip
            await producer.abort_transaction()
        finally:
            await producer.stop()
        # Then the worker's lag of the partition comes down to 0 at its end (it stayed at 2:
        # a lag alert on every partition a transactional publisher writes to), and its
        # group's committed offset reaches the end (a restart need not read the two again)
        await until(lambda: (worker.log.end_offset(partition), worker.consumer_lag()[partition]) == (2, 0), 60,
                    "no lag at the partition's end")  # fmt: skip
        admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
        await admin.start()
        try:
            async def committed() -> int | None:
                offsets = await admin.list_consumer_group_offsets(group)
                found = offsets.get(TopicPartition(fresh_topics.events, partition))
                return None if found is None else found.offset

            deadline = asyncio.get_running_loop().time() + 30
            while await committed() != 2:
                assert asyncio.get_running_loop().time() < deadline, f"committed {await committed()}, not 2"
                await asyncio.sleep(0.2)
        finally:
            await admin.close()
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)

