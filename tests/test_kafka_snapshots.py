"""Snapshots on the real broker: a second worker joins while the first writes snapshots at
every checkpoint (a rebalance mid-snapshot), and nothing is lost -- every message claimed
once, every turn one outcome -- and a worker that then takes the whole group over starts
from the snapshots and holds exactly the state a full replay of the log gives."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from fault_audit import check_invariants, counts, fold_records, until_settled
from kafka_fixtures import fresh_topics, kafka_bootstrap  # noqa: F401  (fixtures)

from turnstile.handlers.claim import DebouncePolicy
from turnstile.handlers.providers.scripted import ScriptedProvider
from turnstile.streams.kafka_log import KafkaLog
from turnstile.streams.kafka_reader import read_topic
from turnstile.streams.log import Topics
from turnstile.streams.publisher import message_event, publish
from turnstile.streams.runtime import SystemClock
from turnstile.streams.snapshots import SnapshotPolicy
from turnstile.streams.worker import Worker, WorkerConfig

pytestmark = pytest.mark.kafka
CONVERSATIONS = 120
NOW = SystemClock().now_ms
# Every checkpoint snapshots whatever changed: snapshots are in flight most of the time.
CONFIG = WorkerConfig(
    debounce=DebouncePolicy(quiet_ms=50, max_wait_ms=200),
    commit_interval_s=0.05,
    snapshots=SnapshotPolicy(idle_ms=0, every_events=1),
)


def running(tasks: list[asyncio.Task[None]]) -> None:
    """Fails at once with what a worker that stopped raised."""
    for task in tasks:
        if task.done():
            task.result()
            raise AssertionError("a worker stopped")


async def test_a_rebalance_while_snapshots_are_written_loses_nothing(
    kafka_bootstrap: str, fresh_topics: Topics  # noqa: F811
) -> None:
    group = f"g-{uuid.uuid4().hex[:8]}"
    publisher = KafkaLog(kafka_bootstrap, group, fresh_topics)
    await publisher.producer.start()
    stop = asyncio.Event()
    workers: list[Worker] = []

    def start_worker() -> asyncio.Task[None]:
        worker = Worker(KafkaLog(kafka_bootstrap, group, fresh_topics), ScriptedProvider(), CONFIG)
        workers.append(worker)
        return asyncio.create_task(worker.run(stop))

    tasks = [start_worker()]
    sent: list[str] = []
    try:
        for round_ in range(3):
            for i in range(CONVERSATIONS):
                event = message_event(f"conv-{i}", f"question {round_} of {i}", NOW(), f"c{i}-m{round_}")
                await publish(publisher, event)
                sent.append(event.message_id)
            if round_ == 0:
                snapshots = workers[0].snapshots
                assert snapshots is not None
                deadline = asyncio.get_running_loop().time() + 60
                while snapshots.written == 0:
                    assert asyncio.get_running_loop().time() < deadline, "no snapshot written"
                    await asyncio.sleep(0.05)
                tasks.append(start_worker())  # joins while snapshots are being written
        try:
            audit = await until_settled(kafka_bootstrap, fresh_topics, sent, 120, alive=lambda: running(tasks))
        except AssertionError as unsettled:  # what each worker holds, for whoever reads the failure
            views = [(w.partition_liveness(), w.consumer_lag(), len(w.runners)) for w in workers]
            raise AssertionError(f"{unsettled}; workers (liveness, lag, turns running): {views}") from None
    finally:
        stop.set()
        await asyncio.gather(*tasks)
    check_invariants(audit)  # every message claimed once, every turn one outcome, ...
    result = counts("rebalance mid-snapshot", audit, 0, sent)
    assert (result.answered, result.answered_twice, result.lost) == (len(sent), 0, 0)
    assert len({p for w in workers for p in w.partition_liveness()}) == 8  # the partitions were shared

    # One worker takes the whole group over: from the snapshots, to the log's state.
    last = Worker(KafkaLog(kafka_bootstrap, group, fresh_topics), ScriptedProvider(), CONFIG)
    last.draining = True  # it only folds: the log stays as the test read it
    stop = asyncio.Event()
    task = asyncio.create_task(last.run(stop))
    try:
        records = await read_topic(kafka_bootstrap, fresh_topics.events)
        deadline = asyncio.get_running_loop().time() + 60
        # (live, and the settled conversations' snapshots fetched into its store)
        while not ((progress := last.replay_progress()).partitions == 8 and progress.replaying == 0
                   and last.states_local):
            assert asyncio.get_running_loop().time() < deadline, "the last worker did not catch up"
            await asyncio.sleep(0.1)
        assert last.snapshots is not None and sum(last.snapshots.seeks.values()) > 0  # not from offset 0
        audit = fold_records(records)
        assert set(last.states) <= set(audit.states)  # the others wait in its local store
        assert all(last.state_of(c) == audit.states[c] for c in audit.states)
    finally:
        stop.set()
        await task
        await publisher.producer.stop()
