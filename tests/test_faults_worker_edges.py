"""Three edges of the worker around rebalances and failed appends, on the embedded log
where they can be staged exactly; all were found while working on the fault scenarios on
Kafka (the third is at the end of the file: nothing may be started for a partition while
it is being revoked).

1. A rebalance that runs while the consumer loop is still working through a polled batch.

The rebalance callbacks run beside the consumer loop: while the loop awaits an append (an
outcome record, a dead letter -- and during a broker outage that await lasts), the group
can revoke the partitions and assign them again, replaying from offset 0. The rest of the
batch polled before the rebalance is stale: folded into the freshly assigned partition it
would jump its position past the replay and make the worker decide on a state built from
a few records (a claim with the wrong history boundary, which every reader then refuses).

The rebalance is simulated on the embedded log, deterministically: the first outcome
record the worker appends triggers revoke + assign (seek to the beginning), exactly as the
Kafka listener calls them.

2. An append of the consumer loop fails (an outage longer than the producer's timeout):
the worker stops, and its final commit must not mark the failed one-time effect done."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping

import pytest
from builders import claim, completed, message, started
from fault_audit import check_invariants, fold_records
from worker_harness import FAST, events_of, running, until

from turnstile.events import DeadLetter, TurnClaimed, TurnCompleted, decode, encode
from turnstile.handlers.providers.scripted import ScriptedProvider
from turnstile.streams.file_log import FileLog, _PartitionReader
from turnstile.streams.log import PartitionStart, RebalanceListener, RecordRefused
from turnstile.streams.metrics import Metrics
from turnstile.streams.runtime import SystemClock
from turnstile.streams.worker import Worker

NOW = SystemClock().now_ms


class RebalanceMidBatch(FileLog):
    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.listener: RebalanceListener | None = None
        self.armed = True

    async def start(self, listener: RebalanceListener) -> None:
        self.listener = listener
        await super().start(listener)

    async def append(
        self, topic: str, key: str, value: bytes, partition: int | None = None, headers: Mapping[str, str] | None = None
    ) -> tuple[int, int]:
        result = await super().append(topic, key, value, partition, headers)
        if topic == self.topics.outcomes and self.armed and self.listener is not None:
            self.armed = False
            everything = set(range(self.partitions))
            await self.listener.on_revoked(everything)
            starts = {}
            for p in everything:  # assigned again, from the beginning
                self._readers[p] = _PartitionReader(self._file(self.topics.events, p).path)
                starts[p] = PartitionStart(self._file(self.topics.events, p).end_offset(), 0)
            await self.listener.on_assigned(starts)
        return result


async def test_the_rest_of_a_batch_polled_before_a_rebalance_is_not_folded(tmp_path) -> None:
    log = RebalanceMidBatch(tmp_path, partitions=1)
    t = NOW() - 60_000  # old enough that no debounce waits: m2 is claimable at once
    first = claim(["m1"], t, 0, conv="c1")
    # One batch: a finished turn (its outcome record triggers the rebalance), then m2.
    for event in (message("m1", t, conv="c1"), first, started(first, t), completed(first, t)):
        await log.append(log.topics.events, "c1", encode(event))
    await log.append(log.topics.events, "c1", encode(message("m2", t + 1, conv="c1")))
    provider = ScriptedProvider()
    async with running(log, provider, FAST):
        await until(lambda: sum(isinstance(e, TurnCompleted) for e in events_of(log, "c1")) == 2, 20)
    audit = fold_records(log.read_all(log.topics.events))
    check_invariants(audit)
    assert audit.ignored == []  # nothing written on a half-built state
    claims = [e for e in events_of(log, "c1") if isinstance(e, TurnClaimed)]
    assert [(c.input_ids, c.history_boundary) for c in claims] == [(("m1",), 0), (("m2",), 2)]
    assert len(provider.requests) == 1


class OutcomeTopicDown(FileLog):
    """Appends to the outcomes topic fail (a broker outage longer than the producer's
    timeout) until `up` is set, as the consumer loop records an outcome."""

    up = False
    refused = 0

    async def append(
        self,
        topic: str,
        key: str | None,
        value: bytes,
        partition: int | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> tuple[int, int]:
        if topic == self.topics.outcomes and not self.up:
            self.refused += 1
            raise self.refusal()
        return await super().append(topic, key, value, partition, headers)

    def refusal(self) -> Exception:
        return TimeoutError("outcomes topic unreachable")


async def test_an_effect_that_cannot_be_written_for_a_while_is_retried_and_never_committed_as_done(tmp_path) -> None:
    """The consumer loop cannot write an outcome record for a while. The worker keeps
    running (and answering later messages), commits no offset past the record whose outcome
    is unwritten, and writes it once the topic is back."""
    t = NOW() - 60_000
    first = claim(["m1"], t, 0, conv="c1")
    broken = OutcomeTopicDown(tmp_path, partitions=1)
    for event in (message("m1", t, conv="c1"), first, started(first, t), completed(first, t)):
        await broken.append(broken.topics.events, "c1", encode(event))
    unwritten_at = 3  # the offset of the TurnCompleted
    async with running(broken, ScriptedProvider(), FAST) as worker:
        await broken.append(broken.topics.events, "c2", encode(message("m2", t, conv="c2")))
        await until(lambda: any(isinstance(e, TurnCompleted) for e in events_of(broken, "c2")), 20)
        await until(lambda: broken.refused >= 3, 20)  # tried again, with backoff
        assert broken.read_all(broken.topics.outcomes) == []
        assert FileLog(tmp_path, partitions=1).committed_offsets().get(0, 0) <= unwritten_at
        broken.up = True
        await until(lambda: len(broken.read_all(broken.topics.outcomes)) == 2, 20)
        await until(lambda: FileLog(tmp_path, partitions=1).committed_offsets().get(0, 0) > 6, 20)
        assert not worker.effects_skipped
    outcomes = [decode(r.value) for r in broken.read_all(broken.topics.outcomes)]
    assert sorted(o.conversation_id for o in outcomes if isinstance(o, TurnCompleted)) == ["c1", "c2"]


class OutcomeTooLarge(OutcomeTopicDown):
    """The outcomes topic refuses every record for good, as Kafka refuses one over its
    max.message.bytes."""

    def refusal(self) -> Exception:
        return RecordRefused("MessageSizeTooLargeError: larger than max.message.bytes")


async def test_an_effect_the_log_refuses_for_good_is_marked_on_the_dlq_counted_and_skipped(tmp_path) -> None:
    log = OutcomeTooLarge(tmp_path, partitions=1)
    metrics = Metrics()
    async with running(log, ScriptedProvider(), FAST, metrics=metrics) as worker:
        await log.append(log.topics.events, "c1", encode(message("m1", NOW() - 60_000, conv="c1")))
        await until(lambda: len(log.read_all(log.topics.dead_letters)) == 1, 20)
        end = len(log.read_all(log.topics.events))
        await until(lambda: log.committed_offsets().get(0, 0) == end, 20)  # moved past it
    [marker] = [DeadLetter.model_validate_json(r.value) for r in log.read_all(log.topics.dead_letters)]
    completed_at = next(r.offset for r in log.read_all(log.topics.events) if b"TurnCompleted" in r.value)
    assert (marker.reason, marker.partition, marker.offset) == ("effect_skipped", 0, completed_at)
    assert log.topics.outcomes in marker.detail and isinstance(decode(marker.original_value()), TurnCompleted)
    assert worker.effects_skipped == 1
    assert b'turnstile_effects_skipped_total{topic="turnstile.outcomes"} 1.0' in metrics.exposition()


class SlowFlush(FileLog):
    """A producer flush that takes a while, as Kafka's does: the consumer loop runs meanwhile."""

    async def flush(self) -> None:
        await asyncio.sleep(0.5)


async def test_nothing_is_started_for_a_partition_while_it_is_being_revoked(tmp_path) -> None:
    """Found on Kafka (scenario 3): while `on_revoked` awaited the cancelled turns and the
    producer flush, the consumer loop saw those turns orphaned and started runners to take
    them over -- runners the revoke then forgot without cancelling. They kept writing (and
    calling the model) for a partition another worker owned."""
    log = SlowFlush(tmp_path, partitions=1)
    # The model step outlasts the revoke's grace: the revoke cuts it off after it.
    worker = Worker(log, ScriptedProvider(delay_s=30.0), dataclasses.replace(FAST, revoke_grace_s=0.5))
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        await log.append(log.topics.events, "c1", encode(message("m1", NOW() - 60_000, conv="c1")))
        await until(lambda: any(e.type == "AttemptStarted" for e in events_of(log, "c1")), 20)
        await until(lambda: not worker._dirty, 5)
        await worker.on_revoked({0})  # what the Kafka listener calls before the group moves it
        written = len(events_of(log))
        await asyncio.sleep(1.0)
        assert len(events_of(log)) == written, [e.type for e in events_of(log)][written:]
        turns = [t for t in asyncio.all_tasks() if t.get_name().startswith("turn:")]
        assert all(t.done() for t in turns), "a runner outlived the revoke"
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


class FailingAssignment(Worker):
    async def on_assigned(self, partitions: dict[int, PartitionStart]) -> dict[int, int]:
        raise OSError("the local store is unreadable")


async def test_a_worker_whose_first_assignment_fails_lets_go_of_the_embedded_log(tmp_path) -> None:
    """The embedded log runs the first assignment inside its start: a failure there ends the
    run with it, and the log's folder is free for the next process step (a restart in the
    same process, `turnstile inspect`) instead of staying owned until the process exits."""
    log = FileLog(tmp_path, partitions=1)
    with pytest.raises(OSError, match="unreadable"):
        await asyncio.wait_for(FailingAssignment(log, ScriptedProvider(), FAST).run(asyncio.Event()), 10)
    FileLog(tmp_path).own()  # raises LogOwned while the failed worker still holds it
