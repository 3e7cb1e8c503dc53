"""On the real broker: a worker restarted under its instance id (static membership) gets
its partitions back and the other member of the group is not rebalanced -- its turns run on."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from aiokafka import TopicPartition
from kafka_fixtures import fresh_topics, kafka_bootstrap  # noqa: F401  (fixtures)

from turnstile.streams.kafka_log import KafkaLog, Membership, MembershipLost, RebalanceFailed
from turnstile.streams.log import PartitionStart, Topics
from turnstile.streams.worker import WorkerConfig

pytestmark = pytest.mark.kafka


class Seen:
    """A rebalance listener that records what the group did to one member."""

    def __init__(self) -> None:
        self.assigned: set[int] = set()
        self.revocations = 0

    async def on_assigned(self, partitions: dict[int, PartitionStart]) -> dict[int, int]:
        self.assigned |= set(partitions)
        return {p: start.committed for p, start in partitions.items()}  # read on from the commits

    async def on_revoked(self, partitions: set[int]) -> None:
        self.revocations += 1
        self.assigned -= partitions


async def polling(log: KafkaLog, stop: asyncio.Event) -> None:
    while not stop.is_set():
        await log.poll(0.1)


async def until(condition, timeout_s: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "the group did not settle in time"
        await asyncio.sleep(0.05)


def test_a_fenced_static_member_is_told_by_the_error_aiokafka_wraps_it_in():
    # (its join, sync and heartbeat paths raise KafkaError(repr(UnknownError())): such a stop
    # was a traceback and exit 1, not the one line and exit 3 of a lost membership)
    from aiokafka.errors import KafkaError, KafkaTimeoutError, UnknownError

    from turnstile.streams.kafka_log import fenced

    assert fenced(UnknownError()) and fenced(KafkaError(repr(UnknownError())))
    wrapped = KafkaError("Unexpected error during coordination")
    wrapped.__cause__ = UnknownError()
    assert fenced(wrapped)
    assert not fenced(KafkaTimeoutError()) and not fenced(KafkaError("Unexpected error during data retrieval"))
    heartbeat = KafkaError(f"Unexpected exception in heartbeat task: {UnknownError()!r}")
    assert fenced(heartbeat) and not fenced(KafkaTimeoutError(repr(UnknownError())))  # a named error is not it


def test_membership_refuses_what_the_broker_would():
    with pytest.raises(ValueError, match=r"outside 6000\.\.1800000"):
        Membership("w1", session_timeout_ms=1_000)
    with pytest.raises(ValueError, match="instance id is empty"):
        Membership(" ")
    # A rebalance is noticed within a second; two lost heartbeats never drop a live member.
    assert Membership("w1", session_timeout_ms=6_000).heartbeat_interval_ms == 1_000
    assert all(Membership("w1", session_timeout_ms=ms).heartbeat_interval_ms * 3 <= ms for ms in (6_000, 1_800_000))
    # A revoke's wait (the grace, then a flush and a commit) fits the group's rebalance
    # timeout whatever the session, with room: a member that outlasts it would be dropped.
    grace_ms = WorkerConfig().revoke_grace_s * 1000
    for ms in (6_000, 10_000):
        assert Membership("w1", session_timeout_ms=ms).rebalance_timeout_ms >= ms + 2 * grace_ms


async def test_the_longest_session_timeout_allowed_is_one_the_broker_takes(
    kafka_bootstrap: str,  # noqa: F811
    fresh_topics: Topics,  # noqa: F811
):
    # (the bound was 300 s, "the broker's", where Kafka's default has been 30 min since 2.0)
    log = KafkaLog(kafka_bootstrap, f"g-{uuid.uuid4().hex[:8]}", fresh_topics, membership=Membership(None, 1_800_000))
    seen, stop = Seen(), asyncio.Event()
    await log.start(seen)
    task = asyncio.create_task(polling(log, stop))
    try:
        await until(lambda: len(seen.assigned) == 8)
    finally:
        stop.set()
        await task
        await log.stop()


async def test_a_worker_restarted_under_its_instance_id_takes_its_partitions_back_without_a_rebalance(
    kafka_bootstrap: str,  # noqa: F811
    fresh_topics: Topics,  # noqa: F811
):
    group = f"g-{uuid.uuid4().hex[:8]}"

    def member(name: str) -> KafkaLog:
        return KafkaLog(kafka_bootstrap, group, fresh_topics, membership=Membership(name, 30_000))

    stop_a, stop_b = asyncio.Event(), asyncio.Event()
    a, b, b_again = member("worker-a"), member("worker-b"), member("worker-b")
    seen_a, seen_b, seen_b_again = Seen(), Seen(), Seen()
    await a.start(seen_a)
    task_a = asyncio.create_task(polling(a, stop_a))
    try:
        await until(lambda: len(seen_a.assigned) == 8)
        await b.start(seen_b)
        task_b = asyncio.create_task(polling(b, stop_b))
        await until(lambda: seen_a.assigned and seen_b.assigned and len(seen_a.assigned | seen_b.assigned) == 8)
        kept_by_a, held_by_b, revocations = set(seen_a.assigned), set(seen_b.assigned), seen_a.revocations

        stop_b.set()  # a deploy stops worker-b ...
        await task_b
        await b.stop()
        await b_again.start(seen_b_again)  # ... and starts it again under the same name
        stop_b_again = asyncio.Event()
        task_b_again = asyncio.create_task(polling(b_again, stop_b_again))
        await until(lambda: seen_b_again.assigned == held_by_b)
        # worker-a's assignment is the group's verdict: a rebalance would revoke it before
        # worker-b' could be assigned anything, and it was not.
        assert (seen_a.revocations, seen_a.assigned) == (revocations, kept_by_a)
        stop_b_again.set()
        await task_b_again
        await b_again.stop()
    finally:
        stop_a.set()
        await task_a
        await a.stop()


class FailsToAssign(Seen):
    """A worker whose part of the assignment raises (a broker call that gave up, a bug)."""

    def __init__(self) -> None:
        super().__init__()
        self.tried = asyncio.Event()

    async def on_assigned(self, partitions: dict[int, PartitionStart]) -> dict[int, int]:
        self.tried.set()
        raise ConnectionError("the snapshot topic went away mid-load")


async def test_a_worker_whose_assignment_failed_stops_with_the_reason_rather_than_polling_on_blind(
    kafka_bootstrap: str,  # noqa: F811
    fresh_topics: Topics,  # noqa: F811
):
    # aiokafka only logs what a rebalance listener raises: without this, the member would go
    # on polling partitions it never took, its records dropped and its turns held forever.
    broken = KafkaLog(kafka_bootstrap, f"g-{uuid.uuid4().hex[:8]}", fresh_topics)
    await broken.start(FailsToAssign())
    try:
        async with asyncio.timeout(60):
            with pytest.raises(RebalanceFailed, match=r"\(assignment\) failed: ConnectionError\('the snapshot topic"):
                while True:
                    await broken.poll(0.1)
    finally:
        await broken.stop()


class CancelledInside(Seen):
    """A revoke whose own awaits end in a CancelledError that is not the consumer stopping."""

    async def on_revoked(self, partitions: set[int]) -> None:
        raise asyncio.CancelledError()


async def test_a_cancellation_raised_inside_the_workers_revoke_is_a_failure_too(
    kafka_bootstrap: str,  # noqa: F811
    fresh_topics: Topics,  # noqa: F811
):
    group = f"g-{uuid.uuid4().hex[:8]}"
    first, second = KafkaLog(kafka_bootstrap, group, fresh_topics), KafkaLog(kafka_bootstrap, group, fresh_topics)
    seen = CancelledInside()
    await first.start(seen)
    stop = asyncio.Event()
    try:
        async with asyncio.timeout(60):
            while len(seen.assigned) < 8:
                await first.poll(0.1)
            await second.start(Seen())  # a rebalance: the first member revokes
            task = asyncio.create_task(polling(second, stop))
            with pytest.raises(RebalanceFailed, match=r"\(revoke\) failed: CancelledError"):
                while True:
                    await first.poll(0.1)
        stop.set()
        await task
    finally:
        stop.set()
        await asyncio.gather(first.stop(), second.stop())


async def test_an_assignment_that_failed_after_the_last_poll_fails_the_stop(
    kafka_bootstrap: str,  # noqa: F811
    fresh_topics: Topics,  # noqa: F811
):
    # A worker stopping with no turn in flight polls no more: the failure surfaces at the stop.
    broken, listener = KafkaLog(kafka_bootstrap, f"g-{uuid.uuid4().hex[:8]}", fresh_topics), FailsToAssign()
    await broken.start(listener)
    await asyncio.wait_for(listener.tried.wait(), 60)
    with pytest.raises(RebalanceFailed, match=r"\(assignment\) failed"):
        await broken.stop()


class SlowToLoad(Seen):
    """A worker whose first assignment outlasts the session timeout, as a new owner's load of
    a million conversations' heads does (≈ 22 s)."""

    def __init__(self, load_s: float) -> None:
        super().__init__()
        self.load_s = load_s
        self.assignments = 0

    async def on_assigned(self, partitions: dict[int, PartitionStart]) -> dict[int, int]:
        self.assignments += 1
        if self.assignments == 1:
            await asyncio.sleep(self.load_s)  # the load (a stand-in: what matters is how long)
        return await super().on_assigned(partitions)


async def test_an_assignment_that_outlasts_the_session_timeout_keeps_the_member_in_the_group(
    kafka_bootstrap: str,  # noqa: F811
    fresh_topics: Topics,  # noqa: F811
):
    # aiokafka sends no heartbeat while an assignment callback runs: a load inside it (as
    # before) got the member dropped at the session timeout, and the commit right after the
    # load was refused. The Kafka log takes the assignment beside the group's protocol.
    log = KafkaLog(kafka_bootstrap, f"g-{uuid.uuid4().hex[:8]}", fresh_topics, membership=Membership(None, 6_000))
    seen, stop = SlowToLoad(load_s=9.0), asyncio.Event()
    await log.start(seen)
    task = asyncio.create_task(polling(log, stop))
    try:
        await until(lambda: len(seen.assigned) == 8)
        await log.consumer.commit({TopicPartition(fresh_topics.events, p): 0 for p in range(8)})
        assert seen.assignments == 1
    finally:
        stop.set()
        await task
        await log.stop()


class HeldLoad(Seen):
    """A worker whose first load is held until the test lets it go (a new owner's load of a
    million conversations' heads, ≈ 22 s); it records whether that load was abandoned."""

    def __init__(self) -> None:
        super().__init__()
        self.loading, self.abandoned, self.release = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def on_assigned(self, partitions: dict[int, PartitionStart]) -> dict[int, int]:
        if not self.loading.is_set():
            self.loading.set()
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                self.abandoned.set()
                raise
        return await super().on_assigned(partitions)


async def test_a_member_joining_while_another_loads_is_given_its_share_and_the_load_is_abandoned_not_waited_for(
    kafka_bootstrap: str,  # noqa: F811
    fresh_topics: Topics,  # noqa: F811
):
    # Inside the assignment callback, a load held the whole group: the joining member waited
    # for it (past the rebalance timeout the loader was dropped, its load never ending).
    group = f"g-{uuid.uuid4().hex[:8]}"
    loader, joiner = KafkaLog(kafka_bootstrap, group, fresh_topics), KafkaLog(kafka_bootstrap, group, fresh_topics)
    await loader.start_producer()
    for p in range(8):  # one record on each partition, for whichever member owns it to read
        await loader.append(fresh_topics.events, f"c{p}", b"{}", partition=p)
    held, seen_joiner = HeldLoad(), Seen()
    read: dict[int, list[int]] = {}

    async def reading(log: KafkaLog, stop: asyncio.Event) -> None:
        while not stop.is_set():
            for record in await log.poll(0.1):
                read.setdefault(record.partition, []).append(record.offset)

    stop = asyncio.Event()
    await loader.start(held)
    tasks = [asyncio.create_task(reading(loader, stop))]
    try:
        async with asyncio.timeout(60):
            await held.loading.wait()
        # While it loads, nothing of its partitions is fetched.
        assert loader.consumer.paused() == loader.consumer.assignment() and len(loader.consumer.assignment()) == 8
        await joiner.start(seen_joiner)
        tasks.append(asyncio.create_task(reading(joiner, stop)))
        await until(lambda: held.assigned and seen_joiner.assigned and len(held.assigned | seen_joiner.assigned) == 8)
        assert held.abandoned.is_set()  # the held load was cancelled by the rebalance, not waited for
        assert not held.release.is_set()
        # Each member reads its partitions from where its listener said (the commits: 0).
        await until(lambda: sorted(read) == list(range(8)))
        assert all(offsets == [0] for offsets in read.values())
        assert not loader.consumer.paused() and not joiner.consumer.paused()
    finally:
        held.release.set()  # (a load still held -- the test failed -- must not hold the stop too)
        stop.set()
        await asyncio.gather(*tasks)
        await asyncio.gather(loader.stop(), joiner.stop())


class TakesKeptFirst(Seen):
    """A worker given partitions it held (0-3) and new ones (4-7): it reads the kept ones at
    once, from where its fold stands, and holds the new ones' load until the test lets it go."""

    def __init__(self, log: KafkaLog) -> None:
        super().__init__()
        self.log = log
        self.took, self.release = asyncio.Event(), asyncio.Event()

    async def on_assigned(self, partitions: dict[int, PartitionStart]) -> dict[int, int]:
        self.log.take({p: 0 for p in partitions if p < 4})
        self.took.set()
        await self.release.wait()
        self.assigned |= set(partitions)
        return {p: 1 if p < 4 else 0 for p in partitions}  # the kept ones folded past their record


async def test_partitions_taken_during_an_assignment_are_read_while_the_rest_still_load(
    kafka_bootstrap: str,  # noqa: F811
    fresh_topics: Topics,  # noqa: F811
):
    log = KafkaLog(kafka_bootstrap, f"g-{uuid.uuid4().hex[:8]}", fresh_topics)
    await log.start_producer()
    for p in range(8):  # one record on each partition
        await log.append(fresh_topics.events, f"c{p}", b"{}", partition=p)
    listener, stop = TakesKeptFirst(log), asyncio.Event()
    read: dict[int, list[int]] = {}

    async def reading() -> None:
        while not stop.is_set():
            for record in await log.poll(0.1):
                read.setdefault(record.partition, []).append(record.offset)

    await log.start(listener)
    task = asyncio.create_task(reading())
    try:
        async with asyncio.timeout(60):
            await listener.took.wait()
        # While the assignment is still being taken, the partitions taken are read ...
        await until(lambda: sorted(read) == [0, 1, 2, 3])
        # ... and the others stay paused
        assert log.consumer.paused() == {TopicPartition(fresh_topics.events, p) for p in range(4, 8)}
        listener.release.set()
        # Once it is taken, each is read on from where the listener said: nothing twice
        # (a second record on each, read after the first)
        await until(lambda: sorted(read) == list(range(8)))
        for p in range(8):
            await log.append(fresh_topics.events, f"c{p}", b"{}", partition=p)
        await until(lambda: all(len(read.get(p, [])) >= 2 for p in range(8)))
        assert all(offsets == [0, 1] for offsets in read.values()) and not log.consumer.paused()
    finally:
        listener.release.set()
        stop.set()
        await task
        await log.stop()


async def test_of_two_workers_under_one_instance_id_one_stops_rather_than_both_run_the_same_turns(
    kafka_bootstrap: str,  # noqa: F811
    fresh_topics: Topics,  # noqa: F811
):
    # Two live processes under one --instance-id fence each other in turn, each running the
    # turns of the partitions it got back: the one the group no longer knows stops (which one
    # depends on whose heartbeat or commit the broker refuses first).
    group = f"g-{uuid.uuid4().hex[:8]}"
    first = KafkaLog(kafka_bootstrap, group, fresh_topics, membership=Membership("pod-a"))
    second = KafkaLog(kafka_bootstrap, group, fresh_topics, membership=Membership("pod-a"))
    seen = Seen()
    await first.start(seen)
    try:
        async with asyncio.timeout(60):
            await until_polled(first, lambda: len(seen.assigned) == 8)
            await second.start(Seen())  # the same instance id: the group now knows only this one
            running = [asyncio.create_task(committing(log)) for log in (first, second)]
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_EXCEPTION)
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
        # One of the two no longer runs (how the broker's refusal reaches aiokafka varies: the
        # mapping of each way to MembershipLost is pinned in tests/test_membership_lost.py).
        stopped = [task.exception() for task in done]
        assert stopped and all(not isinstance(e, MembershipLost) or "'pod-a'" in str(e) for e in stopped)
    finally:
        await first.stop()
        await second.stop()


async def committing(log: KafkaLog) -> None:
    """Polls and commits what it owns, as a worker does, until the log raises."""
    while True:
        await log.poll(0.1)
        await log.commit(dict.fromkeys(range(8), 0))


async def until_polled(log: KafkaLog, condition) -> None:  # type: ignore[no-untyped-def]
    while not condition():
        await log.poll(0.1)
