"""The Kafka log: an aiokafka consumer in a consumer group and an idempotent producer.

Why aiokafka directly rather than a faust agent on the hot path: the worker must (1)
replay each newly assigned partition from the beginning before deciding anything, since
the events topic *is* the state's changelog; (2) keep consuming a partition while a
slow model call runs for one of its conversations; (3) commit offsets only as a marker
of processed one-time effects. faust acks and commits per event as its agent finishes
it and recovers tables from a second changelog; both fight (1) and (2).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, cast

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import (
    InvalidTopicError,
    KafkaError,
    MessageSizeTooLargeError,
    OutOfOrderSequenceNumber,
    RecordListTooLargeError,
    RecordTooLargeError,
    TopicAuthorizationFailedError,
    UnknownError,
    UnknownMemberIdError,
)
from aiokafka.structs import OffsetAndMetadata

from turnstile.streams.append_batch import AppendBatcher
from turnstile.streams.kafka_reader import (
    KafkaReader,
    PointReader,
    ensure_snapshot_topic,
    read_partitions,
    record_of,
)
from turnstile.streams.log import (
    BROKER_DEFAULT_MAX_MESSAGE_BYTES,
    MAX_REQUEST_BYTES,
    Acknowledged,
    PartitionStart,
    RebalanceListener,
    Record,
    RecordRefused,
    Topics,
    partition_for,
    value_limit,
)
from turnstile.streams.worker_groups import warn_of_groups_beside

log = logging.getLogger(__name__)

# How long reading a topic's partitions outside the group (the snapshots, on assignment) may take.
READ_TIMEOUT_S = 60.0
# Records one poll returns at most: the consumer loop decodes them before it can let the
# event loop run, so a poll stays a small slice of it (bench section 11).
POLL_RECORDS = 250
# A broker that is away holds a commit (aiokafka looks for the group's coordinator without
# end) and a client's stop (the producer waits for batches a killed leader never takes) for
# ever: each is given this long, then skipped, so a worker stops when told to. What was not
# committed is redone by the next owner.
BROKER_WAIT_S = 10.0
_NEVER_WRITABLE = (
    MessageSizeTooLargeError,
    RecordTooLargeError,
    RecordListTooLargeError,
    InvalidTopicError,
    TopicAuthorizationFailedError,
)


def bootstrap_of(url: str) -> str:
    """`kafka://host:port[,host:port]` or a bare `host:port` list -> aiokafka bootstrap."""
    return url.removeprefix("kafka://")


class RebalanceFailed(RuntimeError):
    """The worker's part of a rebalance raised: which partitions it folds is unknown, so the
    consumer loop stops with it (the group gives the partitions to a member that works)."""


def fenced(exc: BaseException) -> bool:
    """Whether a consumer's error is the group's FENCED_INSTANCE_ID, which aiokafka does not
    know: an `UnknownError`, as it is, or wrapped by the coordinator's join, sync and
    heartbeat paths in a plain `KafkaError` that names it ("KafkaError: UnknownError()").
    (Any code aiokafka cannot name reaches us so: the stop says which error it was.)"""
    if isinstance(exc, UnknownError) or isinstance(exc.__cause__, UnknownError):
        return True
    return type(exc) is KafkaError and "UnknownError()" in str(exc)


class MembershipLost(RuntimeError):
    """The group no longer knows this static member (its `--instance-id`): another worker
    joined under the same instance id, or this one's session expired. The worker stops
    (crash-only; started again, it rejoins): two workers under one id would each run the
    other's turns, the broker fencing them in turn."""


class ProducerBroken(RuntimeError):
    """The idempotent producer's sequence of a partition broke: a record the broker refused
    (a topic's `max.message.bytes` lowered below what this worker read at start) leaves
    every later record of that partition refused as out of order. The worker stops
    (crash-only): started again, it reads the topics' limits anew and its producer starts
    a fresh sequence. Going on would leave the partition's turns failing and its messages
    pending while the worker looks healthy."""


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]
    """aiokafka calls these from its group coordinator and only logs what they raise: a
    worker whose assignment failed would go on polling partitions it never took, dropping
    their records, with its turns held forever. The failure is kept for `KafkaLog.poll` (or
    `stop`) to raise.

    The worker takes its partitions beside the group's protocol, not inside it: a new owner
    loads its partitions' snapshot heads first (≈ 22 µs per conversation: ≈ 22 s at a million),
    and for as long as an assignment callback runs, aiokafka neither heartbeats nor rejoins a
    rebalance another member starts -- the group would drop the member past the session
    timeout, and every other member would wait for it. So the callback only pauses the
    partitions and starts the worker's part as a task; the partitions are sought to where the
    worker says and resumed when it is done. Kafka Streams restores its state stores the same
    way, outside the rebalance, with the task's partitions paused."""

    def __init__(self, owner: KafkaLog, listener: RebalanceListener) -> None:
        self.owner = owner
        self.listener = listener
        self.failure: tuple[str, BaseException] | None = None  # (which part, what it raised)
        self.assigning: asyncio.Task[None] | None = None  # the worker taking the latest assignment

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        # An assignment still being taken is abandoned: the group is moving on, and the worker
        # takes nothing of it (its partitions stay paused until the next assignment). It is
        # told even when nothing is revoked: what it held before that assignment and is not
        # in it is no longer its own.
        abandoned = await self.abandon_assignment()
        # Awaited before the group rebalances: the worker stops its turns for these
        # partitions here, so the next owner never sees two writers of one conversation.
        if (revoked or abandoned) and not self.owner.stopping:
            await self._guarded("revoke", self.listener.on_revoked({tp.partition for tp in revoked}))

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        # A stopping consumer still finishes a rebalance in flight: the worker, closed by
        # then, is not told of partitions it will never read (nor loads their snapshots).
        await self.abandon_assignment()
        if self.owner.stopping:
            return
        if assigned:  # nothing of them is fetched until the worker has taken them
            self.owner.consumer.pause(*assigned)
        self.assigning = asyncio.create_task(self._guarded("assignment", self._assigned(assigned)), name="assignment")

    async def abandon_assignment(self) -> bool:
        """Cancel the worker's part of an assignment still in progress and wait for it to end;
        whether there was one."""
        task, self.assigning = self.assigning, None
        if task is None or task.done():
            return False
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return True

    async def _assigned(self, assigned: set[TopicPartition]) -> None:
        # Called with nothing too: the listener learns that what it held moved away.
        consumer = self.owner.consumer
        ends = await consumer.end_offsets(list(assigned)) if assigned else {}
        starts = {}
        for tp in assigned:
            committed = await consumer.committed(tp)
            starts[tp.partition] = PartitionStart(ends[tp], committed or 0)
        positions = await self.listener.on_assigned(starts)
        # At once (no await): the listener reads nothing of these partitions until it
        # returns, and nothing from elsewhere must reach it after. (A rebalance meanwhile
        # would have cancelled this.) One it left out stays paused: it took nothing (stopping).
        self.owner.take(positions)

    async def _guarded(self, what: str, step: Coroutine[Any, Any, None]) -> None:
        try:
            await step
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the consumer is stopping, or a rebalance abandoned the assignment
            self._failed(what, exc)  # one raised inside the worker's part (not a cancellation)
        except Exception as exc:
            self._failed(what, exc)

    def _failed(self, what: str, exc: BaseException) -> None:
        log.error("the worker's %s failed: the worker stops", what, exc_info=exc)
        self.failure = self.failure or (what, exc)


# What a rebalance allows a member beyond its session timeout to rejoin: a revoke's grace
# (`WorkerConfig.revoke_grace_s`, 5 s by default) and its flush and commit, with room to spare.
REVOKE_ROOM_MS = 10_000


@dataclass(frozen=True, slots=True)
class Membership:
    """How this worker belongs to its consumer group.

    With an `instance_id` (KIP-345 static membership; a StatefulSet pod name, a host name)
    a worker that stops does not leave the group, and one that comes back under the same
    id within the session timeout gets its partitions back without a rebalance: the other
    workers' turns run on. The price: the partitions of a member that died wait for the
    session timeout before another member takes them, so it bounds the pause a crash puts
    on its conversations. Without an instance id a clean stop leaves the group at once.
    """

    instance_id: str | None = None
    session_timeout_ms: int = 10_000

    def __post_init__(self) -> None:
        if self.instance_id is not None and not self.instance_id.strip():
            raise ValueError("the group instance id is empty: give a stable name, or none")
        if not 6_000 <= self.session_timeout_ms <= 1_800_000:
            # The broker's default group.min/max.session.timeout.ms (6 s, 30 min since Kafka 2.0);
            # outside them it refuses the join.
            raise ValueError(f"session timeout {self.session_timeout_ms} ms is outside 6000..1800000 ms")

    @property
    def rebalance_timeout_ms(self) -> int:
        """How long the group waits for a member to rejoin in a rebalance. aiokafka's default
        is the session timeout; a revoke waits for the steps in progress (the worker's
        `revoke_grace_s`, 5 s) and then flushes and commits, so it gets that much more room
        whatever the session: a member slower than this is dropped and its partitions move."""
        return self.session_timeout_ms + REVOKE_ROOM_MS

    @property
    def heartbeat_interval_ms(self) -> int:
        # A member learns of a rebalance only from its next heartbeat's answer: after a crash
        # the survivors join up to one interval after the session timeout. Once a second (a
        # small request) keeps that under 1 s; at most a third of the session, so that two
        # lost heartbeats do not drop a live member.
        return min(1_000, self.session_timeout_ms // 3)


class KafkaLog:
    def __init__(
        self,
        bootstrap: str,
        group_id: str = "turnstile-worker",
        topics: Topics = Topics(),
        client_id: str = "turnstile",
        membership: Membership = Membership(),
    ) -> None:
        self.topics = topics
        # The clients are made on first use: aiokafka binds them to the running loop, and a
        # KafkaLog may be configured before any loop runs (an Agent at import time).
        self._consumer_options: dict[str, Any] = dict(
            bootstrap_servers=bootstrap,
            group_id=group_id,
            client_id=client_id,
            group_instance_id=membership.instance_id,
            session_timeout_ms=membership.session_timeout_ms,
            heartbeat_interval_ms=membership.heartbeat_interval_ms,
            rebalance_timeout_ms=membership.rebalance_timeout_ms,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            isolation_level="read_committed",
            max_poll_records=POLL_RECORDS,
        )
        # Idempotent: a retried send after a lost acknowledgement is written once.
        self._producer_options: dict[str, Any] = dict(
            bootstrap_servers=bootstrap,
            client_id=client_id,
            enable_idempotence=True,
            acks="all",
            linger_ms=0,
            # Many turns append at once; 16 KiB batches made the client spin in wait_drain
            # (bench: CPU per record roughly halves with 1 MiB).
            max_batch_size=1 << 20,
            max_request_size=MAX_REQUEST_BYTES,
        )
        self._consumer: AIOKafkaConsumer | None = None
        self._producer: AIOKafkaProducer | None = None
        self._listener: _Listener | None = None
        self._failure_raised = False
        self._instance_id = membership.instance_id
        self._lost: BaseException | None = None  # why the group no longer knows this static member
        self.stopping = False  # from `stop` on, rebalances are no longer the listener's business
        self.bootstrap = bootstrap
        # topic -> its `max.message.bytes`, read at start for the topics effects go to.
        self.max_message_bytes: dict[str, int] = {}
        self._partition_counts: dict[str, int] = {}
        self._point_reader = PointReader(bootstrap)
        # The appends of one loop cycle, one produce per partition (`streams/append_batch.py`).
        self._batcher = AppendBatcher(
            lambda: self.producer, lambda topic: self.max_value_bytes(topic, None), self._refused
        )
        self._broken: BaseException | None = None  # why the producer can no longer append

    @property
    def consumer(self) -> AIOKafkaConsumer:
        if self._consumer is None:
            self._consumer = AIOKafkaConsumer(**self._consumer_options)
        return self._consumer

    @property
    def producer(self) -> AIOKafkaProducer:
        if self._producer is None:
            self._producer = AIOKafkaProducer(**self._producer_options)
        return self._producer

    def own(self) -> None:
        return None  # the consumer group decides who folds which partition

    def partition_count(self) -> int | None:
        # Known once the consumer has the topic's metadata (after it subscribed), then kept: the
        # count is fixed for the topic's life, and a metadata refresh that drops the topic for a
        # moment must not make it unknown (every reader decides where a record belongs by it).
        count = self._partition_counts.get(self.topics.events)
        if count is None and self._consumer is not None:
            found = self._consumer.partitions_for_topic(self.topics.events)
            if found:
                count = self._partition_counts[self.topics.events] = len(found)
        return count

    def partition_for(self, key: str) -> int | None:
        count = self.partition_count()
        return None if count is None else partition_for(key, count)

    def end_offset(self, partition: int) -> int | None:
        """The high watermark of the partition's last fetch (None before one)."""
        if self._consumer is None:
            return None
        end: int | None = self._consumer.highwater(TopicPartition(self.topics.events, partition))
        return end

    async def read_position(self, partition: int) -> int | None:
        """The consumer's position: read_committed, it passes transaction markers and aborted
        records without delivering them. Valid at once for a partition of the assignment
        (the worker's listener seeks each one), so this awaits nothing."""
        tp = TopicPartition(self.topics.events, partition)
        if self._consumer is None or tp not in self._consumer.assignment():
            return None
        position: int = await self._consumer.position(tp)
        return position

    def reader(self) -> KafkaReader:
        return KafkaReader(self.bootstrap, self.topics)

    async def start_producer(self) -> None:
        await self.producer.start()

    async def start(self, listener: RebalanceListener) -> None:
        # The events topic's too: a turn measures its events against it (a smaller one than the
        # broker's default would refuse them, breaking the partition's idempotent sequence).
        await ensure_snapshot_topic(self.bootstrap, self.topics)
        # The snapshot topics' too, made here or by the operator with a limit of their own: a
        # snapshot over it would be refused on every try, holding up the others behind it.
        written = [self.topics.events, self.topics.outcomes, self.topics.dead_letters, self.topics.snapshots,
                   self.topics.heads]  # fmt: skip
        self.max_message_bytes = await topic_max_message_bytes(self.bootstrap, written)
        await self.producer.start()
        # Before joining: a second group of workers on these topics runs every turn again.
        await warn_of_groups_beside(self.bootstrap, self.topics.events, self._consumer_options["group_id"])
        await self.consumer.start()
        self._listener = _Listener(self, listener)
        self.consumer.subscribe([self.topics.events], listener=self._listener)

    def take(self, positions: Mapping[int, int]) -> None:
        # From the assignment task (`_Listener._assigned`), with no await between the worker's
        # answer and this: the partitions of the assignment it names are read from now on,
        # from there (the kept ones before the worker's load, every one when it returns).
        owned = self.consumer.assignment()
        taken = [tp for p in positions if (tp := TopicPartition(self.topics.events, p)) in owned]
        if len(taken) < len(positions):  # (a rebalance cancels the assignment task first)
            log.warning("partitions %s taken outside the consumer's assignment", sorted(positions))
        for tp in taken:
            self.consumer.seek(tp, positions[tp.partition])
        self.consumer.resume(*taken)

    async def poll(self, timeout_s: float) -> list[Record]:
        """What arrived; raises `RebalanceFailed` once the worker's part of a rebalance failed,
        `ProducerBroken` once appends cannot go on."""
        self._raise_a_failed_rebalance()
        self._raise_if_broken()
        try:
            batches = await self.consumer.getmany(timeout_ms=int(timeout_s * 1000), max_records=POLL_RECORDS)
        except KafkaError as exc:
            # The group's answer to a static member another process fenced (FENCED_INSTANCE_ID,
            # a code aiokafka does not know) comes out of a rejoin as an unknown error.
            if self._instance_id is None or not fenced(exc):
                raise
            self._lost = self._lost or exc
        self._raise_a_failed_rebalance()  # (a rebalance may run while getmany waits)
        self._raise_if_broken()
        if self._lost is not None:
            self._failure_raised = True
            raise MembershipLost(
                f"the group no longer knows this worker as --instance-id {self._instance_id!r}: another worker "
                "runs under the same id, or this one's session expired; it stops (give each worker its own id)"
                f" [{_named(self._lost)}]"
            ) from self._lost
        return [record_of(tp.partition, m) for tp, messages in batches.items() for m in messages]

    def _raise_if_broken(self) -> None:
        if self._broken is not None:
            self._failure_raised = True
            raise ProducerBroken(
                f"appends to the log fail out of order since a record in flight was refused or lost "
                f"({self._broken!r}): the broker was away longer than a request may wait (40 s: its batches "
                "expired), or a topic's max.message.bytes was lowered while the worker ran; it stops, and started "
                "again it writes with a new producer id and reads the limits anew"
            ) from self._broken

    def _refused(self, exc: BaseException) -> BaseException:
        """A failed append, as its caller gets it; one that breaks the producer's sequence is
        noted for the next poll to stop the worker on."""
        if isinstance(exc, OutOfOrderSequenceNumber) and self._broken is None:
            self._broken = exc
            log.error("the producer's sequence broke (%r): the worker stops at its next poll", exc)
        return _refused(exc)

    def _raise_a_failed_rebalance(self) -> None:
        if self._listener is not None and self._listener.failure is not None:
            what, exc = self._listener.failure
            self._failure_raised = True
            raise RebalanceFailed(f"the worker's part of a rebalance ({what}) failed: {exc!r}") from exc

    async def append(
        self,
        topic: str,
        key: str | None,
        value: bytes,
        partition: int | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> tuple[int, int]:
        wire = [(name, text.encode()) for name, text in headers.items()] if headers else None
        key_bytes = None if key is None else key.encode()
        if partition is None and key is not None:
            partition = self._partition_of(topic, key)
        if not self._batcher.fits(topic, key_bytes, value):
            # Refused before it is sent: a record the broker refuses for its size leaves the
            # idempotent producer's sequence of its partition broken (every later record of
            # the partition fails with OutOfOrderSequenceNumber), so one bad value would
            # stop the partition's appends.
            size = len(value) + len(key_bytes or b"")
            raise RecordRefused(
                f"a record of {size:,} bytes is over what {topic} takes ({self.max_value_bytes(topic, None):,})"
            )
        if partition is not None:
            landed = await self._batcher.append(topic, partition, key_bytes, value, wire)
            return landed.partition, landed.offset
        try:  # no metadata for the topic yet: this first send fetches it
            meta = await self.producer.send_and_wait(
                topic, value=value, key=key_bytes, partition=partition, headers=wire
            )
        except _NEVER_WRITABLE as exc:
            raise RecordRefused(f"{type(exc).__name__}: {exc}") from exc
        return meta.partition, meta.offset

    def _partition_of(self, topic: str, key: str) -> int | None:
        """The partition the producer's default partitioner (murmur2) gives `key`; None until
        the producer has the topic's metadata (its first send fetches it)."""
        count = self._partition_counts.get(topic)
        if count is None:  # asked once: the cluster's answer builds a set each time (~85 µs)
            found = self.producer.client.cluster.partitions_for_topic(topic)
            if not found:
                return None
            count = self._partition_counts[topic] = len(found)  # fixed: more would move keys
        return partition_for(key, count)

    def max_value_bytes(self, topic: str, key: str | None) -> int:
        return value_limit(self.max_message_bytes.get(topic, BROKER_DEFAULT_MAX_MESSAGE_BYTES), key)

    async def send(
        self, topic: str, key: str, value: bytes, partition: int | None = None
    ) -> asyncio.Future[Acknowledged]:
        # Queued for its partition's batch of this loop cycle when this returns, behind the
        # records sent before it; the idempotent producer keeps that order on the log.
        key_bytes = key.encode()
        if partition is None:
            partition = self._partition_of(topic, key)
        if partition is not None and self._batcher.fits(topic, key_bytes, value):
            # A Landed is an Acknowledged (partition, offset); Future is invariant, hence the cast.
            return cast("asyncio.Future[Acknowledged]", self._batcher.append(topic, partition, key_bytes, value, None))
        sent: asyncio.Future[Acknowledged] = await self.producer.send(
            topic, value=value, key=key_bytes, partition=partition
        )
        return sent

    async def commit(self, offsets: dict[int, int]) -> None:
        owned = self.consumer.assignment()
        mine = {
            tp: OffsetAndMetadata(offset, "")
            for p, offset in offsets.items()
            if (tp := TopicPartition(self.topics.events, p)) in owned
        }
        if mine:
            # Sent as a member the group had given an id and a generation (aiokafka resets both
            # on a rebalance's IllegalGeneration, and a revoke's commit then goes out as no
            # member at all: that refusal is no sign of another process under this id).
            coordinator = getattr(self.consumer, "_coordinator", None)
            as_member = bool(getattr(coordinator, "member_id", "")) and getattr(coordinator, "generation", -1) >= 0
            try:
                await asyncio.wait_for(self.consumer.commit(mine), BROKER_WAIT_S)
            except Exception as exc:  # a rebalance in progress, a broker away: the next commit carries it
                if self._instance_id is not None and as_member and isinstance(exc.__cause__, UnknownMemberIdError):
                    self._lost = self._lost or exc  # the group does not know the member it had made
                log.warning("offset commit skipped: %s", exc)

    def read_partitions(
        self, topic: str, partitions: list[int], starts: Mapping[int, int] | None = None
    ) -> AsyncGenerator[list[Record], None]:
        return read_partitions(self.bootstrap, topic, partitions, READ_TIMEOUT_S, starts)

    async def read_at(self, topic: str, partition: int, offsets: list[int]) -> dict[int, Record]:
        return await self._point_reader.read_at(topic, partition, offsets, READ_TIMEOUT_S)

    async def flush(self) -> None:
        await self._batcher.drain()
        await self.producer.flush()

    async def stop(self) -> None:
        self.stopping = True
        if self._listener is not None:
            await self._listener.abandon_assignment()  # (the worker has stopped: it would take nothing)
        clients = [c for c in (self._consumer, self._producer, self._point_reader) if c is not None]
        try:
            async with asyncio.timeout(BROKER_WAIT_S):
                if self._producer is not None:
                    await self._batcher.drain()  # what was appended in the last cycle is sent, not dropped
                await asyncio.gather(*(c.stop() for c in clients), return_exceptions=True)
        except TimeoutError:
            log.warning("the broker did not answer the stop within %g s: the clients are left as they are "
                        "(what is not committed, the next owner redoes)", BROKER_WAIT_S)  # fmt: skip
        if not self._failure_raised:
            # One that failed after the last poll: the stop says so, and the process does not
            # exit as if all went well.
            self._raise_a_failed_rebalance()


def _named(exc: BaseException) -> str:
    """The error by its name and its cause's: aiokafka's CommitFailedError explains itself over
    ten lines, advising `max_poll_interval_ms`, which a fenced static member has no use for."""
    cause = exc.__cause__
    return f"{type(exc).__name__} ({type(cause).__name__})" if cause is not None else type(exc).__name__


def _refused(exc: BaseException) -> BaseException:
    """What a failed send is for its caller: a record the broker will never take is refused
    (`RecordRefused`); anything else is raised as it is (the caller retries)."""
    if isinstance(exc, _NEVER_WRITABLE):
        return RecordRefused(f"{type(exc).__name__}: {exc}")
    return exc


async def topic_max_message_bytes(bootstrap: str, topics: list[str]) -> dict[str, int]:
    """Each topic's `max.message.bytes` (its own setting or the broker's default), by the
    admin client; topics whose config cannot be read are left out."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        await admin.start()
        wanted = [ConfigResource(ConfigResourceType.TOPIC, t, configs={"max.message.bytes": None}) for t in topics]
        found: dict[str, int] = {}
        for response in await admin.describe_configs(wanted):
            for error_code, _message, _type, name, entries in response.resources:
                for entry in entries if error_code == 0 else ():
                    if entry[0] == "max.message.bytes":
                        found[name] = int(entry[1])
        return found
    except Exception as exc:  # an old broker or no describe rights: the broker default stands
        log.warning("could not read max.message.bytes of %s (the broker default is assumed): %r", topics, exc)
        return {}
    finally:
        await admin.close()
