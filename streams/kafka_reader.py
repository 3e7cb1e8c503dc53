"""Reading a topic whole, independent of any consumer group: for `tail`, audits and tests
that must judge the log itself rather than a worker's memory."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Mapping
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError, for_code

from turnstile.streams import kafka_records
from turnstile.streams.log import ReadTooLarge, Record, Topics, partition_for

kafka_records.install()  # every consumer of the process reads what aiokafka's own reader refuses

DELTAS_RETENTION_MS = 3_600_000
# Records a whole-partition read takes from the client at a time: unpacking one fetch of every
# partition (≈ 50,000 small records) at once would hold the loop for a quarter of a second.
READ_SLICE = 1_000


# ApiVersions v0 (api key 18), correlation id 1, client id "turnstile": the request every
# Kafka client sends first, answered by any broker before it knows anything of the client.
_API_VERSIONS = struct.pack(">hhih", 18, 0, 1, 9) + b"turnstile"


def reachable(bootstrap: str, timeout_s: float = 5.0) -> bool:
    """Whether a bootstrap address answers as a Kafka broker does (a cheap pre-check): one
    that accepts a connection and closes it, or answers in another protocol (a TLS port, a
    load balancer with nothing behind it), is not reachable."""
    return any(_answers_as_kafka(address, timeout_s) for address in bootstrap.split(","))


def _answers_as_kafka(address: str, timeout_s: float) -> bool:
    host, _, port = address.strip().rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s) as sock:
            sock.sendall(struct.pack(">i", len(_API_VERSIONS)) + _API_VERSIONS)
            head = b""
            while len(head) < 8:  # the response's size, then the correlation id
                more = sock.recv(8 - len(head))
                if not more:
                    return False
                head += more
    except (OSError, ValueError):
        return False
    size, correlation = struct.unpack(">ii", head)
    return bool(size >= 4 and correlation == 1)


class TopicMissing(LookupError):
    """Topics a command needs are not on the broker."""

    def __init__(self, names: list[str], bootstrap: str) -> None:
        which = ", ".join(repr(name) for name in names)
        said = f"topic {which} does" if len(names) == 1 else f"topics {which} do"
        super().__init__(f"{said} not exist on {bootstrap}")
        self.names = names


async def require_topics(bootstrap: str, names: Iterable[str], timeout_s: float = 30.0) -> None:
    """Raises `TopicMissing` naming each of `names` the cluster's metadata does not have: a
    client would otherwise wait for it, logging an error per metadata refresh, and then fail
    with a traceback (a producer) or idle for ever (a worker subscribed to it)."""
    consumer = _no_group(bootstrap)
    try:
        async with asyncio.timeout(timeout_s):
            await consumer.start()
            present = await consumer.topics()
    finally:
        await consumer.stop()
    missing = [name for name in dict.fromkeys(names) if name not in present]
    if missing:
        raise TopicMissing(missing, bootstrap)


def _no_group(bootstrap: str, *topics: str) -> AIOKafkaConsumer:
    return AIOKafkaConsumer(
        *topics,
        bootstrap_servers=bootstrap,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        isolation_level="read_committed",
    )


@contextlib.asynccontextmanager
async def group_less_consumer(
    bootstrap: str, topic: str, timeout_s: float = 30.0
) -> AsyncIterator[tuple[AIOKafkaConsumer, list[TopicPartition]]]:
    """A consumer in no group, given every partition of `topic`: it commits nothing and
    disturbs no worker. The reset policy must be "earliest": the fetcher resets new
    partitions by it on its own, and a "latest" reset racing a seek would silently skip
    the whole topic."""
    consumer = _no_group(bootstrap)
    try:
        await consumer.start()  # (inside: one that fails to start is stopped all the same)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        # Asked of the cluster's metadata first: a topic that is not there is said at once (a
        # subscription would wait for it, logging an error per metadata refresh).
        async with asyncio.timeout(timeout_s):
            if topic not in await consumer.topics():
                raise TopicMissing([topic], bootstrap)
        consumer.subscribe([topic])
        while not (partitions := sorted(consumer.assignment())):
            if loop.time() > deadline:
                raise LookupError(f"topic {topic!r} has no partitions on {bootstrap}")
            await asyncio.sleep(0.05)
        yield consumer, partitions
    finally:
        await consumer.stop()


async def read_to_end(
    consumer: AIOKafkaConsumer,
    partitions: list[TopicPartition],
    timeout_s: float,
    max_records: int | None = None,
    starts: Mapping[int, int] | None = None,
) -> list[Record]:
    """Every record of `partitions` from the beginning (or the offset `starts` gives) up to
    their end at the time of the call, in partition order. `max_records`: refuse
    (`ReadTooLarge`) before reading any when they hold more."""
    ends = await _positioned(consumer, partitions, starts or {})
    if max_records is not None:
        firsts = await consumer.beginning_offsets(partitions)
        held = sum(ends[tp] - firsts[tp] for tp in partitions)
        if held > max_records:
            raise ReadTooLarge([tp.partition for tp in partitions], held, max_records)
    out: list[Record] = []
    async for chunk in _chunks_to_end(consumer, partitions, timeout_s, ends, starts):
        out.extend(chunk)
    return sorted(out, key=lambda r: (r.partition, r.offset))


async def _positioned(
    consumer: AIOKafkaConsumer, partitions: list[TopicPartition], starts: Mapping[int, int]
) -> dict[TopicPartition, int]:
    """The consumer at each partition's start (its first offset, or the one `starts` gives);
    returns their ends now."""
    if from_first := [tp for tp in partitions if tp.partition not in starts]:
        await consumer.seek_to_beginning(*from_first)
    for tp in partitions:
        if tp.partition in starts:
            consumer.seek(tp, starts[tp.partition])
    ends: dict[TopicPartition, int] = await consumer.end_offsets(partitions)
    return ends


async def _chunks_to_end(
    consumer: AIOKafkaConsumer,
    partitions: list[TopicPartition],
    timeout_s: float,
    ends: Mapping[TopicPartition, int],
    starts: Mapping[int, int] | None = None,
) -> AsyncGenerator[list[Record], None]:
    """The records of the positioned `partitions` up to `ends`, as fetched: a chunk of one
    partition at a time, in its order."""
    starts = starts or {}
    remaining = {tp for tp in partitions if ends[tp] > starts.get(tp.partition, 0)}
    deadline = asyncio.get_running_loop().time() + timeout_s
    while remaining:
        batch = await consumer.getmany(*remaining, timeout_ms=200, max_records=READ_SLICE)
        for tp, messages in batch.items():
            if chunk := [record_of(tp.partition, m) for m in messages if m.offset < ends[tp]]:
                yield chunk
        # Every partition left, not only those that returned records: a take that stopped at
        # the last record of a fetch leaves offsets with no record (a compacted tail, control
        # records) to the next, which moves the position past them and returns nothing.
        for tp in list(remaining):
            if await consumer.position(tp) >= ends[tp]:
                remaining.discard(tp)
        if remaining and not batch and asyncio.get_running_loop().time() > deadline:
            state = {tp.partition: (await consumer.position(tp), ends[tp]) for tp in remaining}
            raise TimeoutError(f"partitions not read to the end: (position, end) {state}")


async def read_topic(bootstrap: str, topic: str, timeout_s: float = 30.0) -> list[Record]:
    """Every record of `topic` up to its end at the time of the call, in partition order."""
    async with group_less_consumer(bootstrap, topic, timeout_s) as (consumer, partitions):
        return await read_to_end(consumer, partitions, timeout_s)


async def read_retained(bootstrap: str, topic: str, timeout_s: float = 30.0) -> tuple[list[Record], dict[int, int]]:
    """Every record of `topic` up to its end, and where each of its partitions starts now
    (past offset 0: retention has deleted its oldest records)."""
    async with group_less_consumer(bootstrap, topic, timeout_s) as (consumer, partitions):
        starts = await consumer.beginning_offsets(partitions)
        records = await read_to_end(consumer, partitions, timeout_s)
        return records, {tp.partition: offset for tp, offset in starts.items()}


async def read_partitions(
    bootstrap: str, topic: str, partitions: list[int], timeout_s: float = 30.0, starts: Mapping[int, int] | None = None
) -> AsyncGenerator[list[Record], None]:
    """The records of these partitions of `topic` (from the offsets `starts` gives), up to
    their end at the time of the call, a fetched batch of one partition at a time."""
    async with group_less_consumer(bootstrap, topic, timeout_s) as (consumer, assigned):
        wanted = [tp for tp in assigned if tp.partition in partitions]
        consumer.pause(*(tp for tp in assigned if tp not in wanted))
        ends = await _positioned(consumer, wanted, starts or {})
        async for chunk in _chunks_to_end(consumer, wanted, timeout_s, ends, starts):
            yield chunk


async def read_conversation(
    bootstrap: str, topic: str, conversation_id: str, timeout_s: float = 30.0, max_records: int | None = None
) -> list[Record]:
    """The records of the conversation's partition, up to its end at the time of the call
    (`ReadTooLarge`, before reading, past `max_records`). Kafka's default partitioner
    (murmur2 of the key) says which partition that is."""
    async with group_less_consumer(bootstrap, topic, timeout_s) as (consumer, assigned):
        tp = next(p for p in assigned if p.partition == partition_for(conversation_id, len(assigned)))
        consumer.pause(*(p for p in assigned if p != tp))
        return await read_to_end(consumer, [tp], timeout_s, max_records)


async def read_span(
    bootstrap: str, topic: str, partition: int, start: int, end: int | None, timeout_s: float = 30.0,
    max_records: int | None = None,
) -> list[Record]:
    """The records of one partition from `start` up to `end` (None: its end at the time of
    the call), by a consumer in no group; `ReadTooLarge` before reading past `max_records`."""
    if end is not None and end <= start:
        return []
    consumer = _no_group(bootstrap)
    try:
        await consumer.start()  # (inside: one that fails to start is stopped all the same)
        tp = TopicPartition(topic, partition)
        consumer.assign([tp])
        out: list[Record] = []
        async with asyncio.timeout(timeout_s):  # a topic that is not there waits on metadata
            if end is None:
                end = (await consumer.end_offsets([tp]))[tp]
            if end <= start:
                return []
            if max_records is not None and end - start > max_records:
                raise ReadTooLarge([partition], end - start, max_records)
            consumer.seek(tp, start)
            while await consumer.position(tp) < end:
                batch = await consumer.getmany(tp, timeout_ms=200)
                out.extend(record_of(partition, m) for m in batch.get(tp, ()) if m.offset < end)
        return out
    finally:
        await consumer.stop()


class PointReader:
    """Records at given offsets, by one consumer in no group kept from read to read: a
    consumer made per read would cost its connection and metadata each time, and these
    reads are one conversation's state while its partition's fold waits."""

    def __init__(self, bootstrap: str) -> None:
        self.bootstrap = bootstrap
        self._consumer: AIOKafkaConsumer | None = None
        self._lock = asyncio.Lock()

    async def read_at(self, topic: str, partition: int, offsets: list[int], timeout_s: float) -> dict[int, Record]:
        async with self._lock:
            if self._consumer is None:
                consumer = _no_group(self.bootstrap)
                try:
                    await consumer.start()
                except BaseException:
                    await consumer.stop()  # not left unclosed when the broker is away
                    raise
                self._consumer = consumer
            consumer = self._consumer
            tp = TopicPartition(topic, partition)
            consumer.assign([tp])
            wanted = sorted(set(offsets))
            out: dict[int, Record] = {}
            async with asyncio.timeout(timeout_s):
                end = (await consumer.end_offsets([tp]))[tp]
                at = 0
                while at < len(wanted) and wanted[at] < end:
                    consumer.seek(tp, wanted[at])
                    messages = (await consumer.getmany(tp, timeout_ms=200)).get(tp, [])
                    for m in messages:
                        out[m.offset] = record_of(partition, m)
                    if messages:  # a fetch brings the offsets after the one sought too
                        while at < len(wanted) and wanted[at] <= messages[-1].offset:
                            at += 1
            return {offset: out[offset] for offset in wanted if offset in out}

    async def stop(self) -> None:
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None


async def partition_count(bootstrap: str, topic: str, timeout_s: float = 30.0) -> int:
    """How many partitions `topic` has, from the cluster's metadata."""
    async with group_less_consumer(bootstrap, topic, timeout_s) as (_consumer, partitions):
        return len(partitions)


class KafkaReader:
    """The Kafka log's `LogReader`: a consumer in no group per read."""

    def __init__(self, bootstrap: str, topics: Topics) -> None:
        self.bootstrap = bootstrap
        self.topics = topics
        self._partitions: int | None = None

    async def read(self, topic: str, timeout_s: float = 30.0) -> list[Record]:
        return await read_topic(self.bootstrap, topic, timeout_s)

    async def conversation(self, conversation_id: str, timeout_s: float = 30.0) -> list[Record]:
        return await read_conversation(self.bootstrap, self.topics.events, conversation_id, timeout_s)

    async def span(self, topic: str, partition: int, start: int, end: int, timeout_s: float = 30.0) -> list[Record]:
        return await read_span(self.bootstrap, topic, partition, start, end, timeout_s)

    async def tail(
        self, topic: str, partition: int, start: int, max_records: int | None = None, timeout_s: float = 30.0
    ) -> list[Record]:
        return await read_span(self.bootstrap, topic, partition, start, None, timeout_s, max_records)

    async def partition_of(self, conversation_id: str, timeout_s: float = 30.0) -> int:
        if self._partitions is None:  # fixed: more partitions would move keys, which the engine forbids
            self._partitions = await partition_count(self.bootstrap, self.topics.events, timeout_s)
        return partition_for(conversation_id, self._partitions)

    def follow(self, topic: str, since_ms: int) -> AsyncIterator[Record]:
        return follow_topic(self.bootstrap, topic, since_ms)


# The snapshot topic keeps the latest value per key (conversation id) for ever: compaction,
# not age, removes a conversation's older snapshots.
SNAPSHOTS_CONFIG = {"cleanup.policy": "compact"}


class TopicsRefused(ValueError):
    """The broker refused to create topics (a replication factor above its brokers, a
    policy, no authorisation): each named with its reason."""


async def ensure_topics(
    bootstrap: str, topics: Topics, partitions: int, replication: int = 1
) -> tuple[list[str], int]:
    """Create the six topics if they are missing (the infra script does the same), with the
    settings the engine relies on; returns the names created and the partition count used:
    an existing events topic's, which the topics co-partitioned with it must have."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        events = await _described(admin, topics.events)
        if events is not None:
            partitions = len(events["partitions"])
        forever = {"retention.ms": "-1"}  # the events are the source of truth; dead letters the only copy
        wanted = [
            NewTopic(topics.events, partitions, replication, topic_configs=forever),
            NewTopic(topics.outcomes, partitions, replication),
            NewTopic(topics.dead_letters, 1, replication, topic_configs=forever),
            # Deltas serve live readers of a reply in progress: an hour is plenty.
            NewTopic(topics.deltas, partitions, replication, topic_configs={"retention.ms": str(DELTAS_RETENTION_MS)}),
            # Co-partitioned with the events: a conversation's snapshot is in the partition of
            # the same number as its events, so an owner of one reads the other.
            NewTopic(topics.snapshots, partitions, replication, topic_configs=SNAPSHOTS_CONFIG),
            NewTopic(topics.heads, partitions, replication, topic_configs=SNAPSHOTS_CONFIG),
        ]
        existing = set(await admin.list_topics())
        created = await _create(admin, [t for t in wanted if t.name not in existing])
        await _until_led(admin, [t.name for t in wanted])
        return created, partitions
    finally:
        await admin.close()


async def _described(admin: AIOKafkaAdminClient, name: str) -> dict[str, Any] | None:
    """The topic as the cluster describes it; None when it is not there."""
    [found] = await admin.describe_topics([name])
    return found if found["error_code"] == 0 and found["partitions"] else None


async def _create(admin: AIOKafkaAdminClient, new: list[NewTopic]) -> list[str]:
    """Create `new`, returning those created here (one another process created at the same
    moment is not); `TopicsRefused` for any the broker refused (it answers per topic, in
    the response, not by raising)."""
    if not new:
        return []
    response = await admin.create_topics(new)
    created, refused = [], []
    for entry in response.topic_errors:
        name, code = entry[0], entry[1]
        if code == 0:
            created.append(name)
        elif code != TopicAlreadyExistsError.errno:
            message = entry[2] if len(entry) > 2 and entry[2] else for_code(code).__name__
            refused.append(f"{name!r}: {message}")
    if refused:
        raise TopicsRefused(f"the broker refused to create {', '.join(refused)}")
    return created


async def ensure_snapshot_topic(bootstrap: str, topics: Topics) -> None:
    """Create the snapshot topic and its heads' if they are missing, with as many partitions
    (and replicas) as the events topic (a deployment made before snapshots has the other
    topics only); refuse one that is not co-partitioned with the events."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        names = [topics.events, topics.snapshots, topics.heads]
        described = {t["topic"]: t for t in await admin.describe_topics(names)}
        events = described.get(topics.events)
        if events is None or events["error_code"] != 0 or not events["partitions"]:
            return  # no events topic yet: the consumer reports that in its own words
        partitions = len(events["partitions"])
        replicas = len(events["partitions"][0]["replicas"]) or 1
        missing = []
        for name in names[1:]:
            found = described.get(name)
            if found is None or found["error_code"] != 0 or not found["partitions"]:
                missing.append(name)
            elif len(found["partitions"]) != partitions:
                raise ValueError(
                    f"topic {name!r} has {len(found['partitions'])} partitions and {topics.events!r}"
                    f" {partitions}: they must be co-partitioned (recreate {name!r})"
                )
        if not missing:
            return
        await _create(admin, [NewTopic(n, partitions, replicas, topic_configs=SNAPSHOTS_CONFIG) for n in missing])
        await _until_led(admin, missing)
    finally:
        await admin.close()


async def _until_led(admin: AIOKafkaAdminClient, names: list[str], timeout_s: float = 15.0) -> None:
    """A created topic takes a moment to have leaders; clients that start sooner see no
    partitions or get NotLeader errors."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        described = await admin.describe_topics(names)
        if len(described) == len(names) and all(
            t["error_code"] == 0 and t["partitions"] and all(p["leader"] >= 0 for p in t["partitions"])
            for t in described
        ):
            return
        if loop.time() > deadline:
            raise TimeoutError(f"topics {names} have no leaders after {timeout_s}s")
        await asyncio.sleep(0.1)


async def follow_topic(bootstrap: str, topic: str, since_ms: int) -> AsyncIterator[Record]:
    """The records of `topic` written from `since_ms` (Unix milliseconds, by record
    timestamp) on, as they arrive, every partition, in no group, until cancelled."""
    async with group_less_consumer(bootstrap, topic) as (consumer, partitions):
        # The ends first: a record written while the two are looked up is then at or past
        # its partition's end, so a partition with nothing since `since_ms` misses nothing.
        ends = await consumer.end_offsets(partitions)
        found = await consumer.offsets_for_times({tp: since_ms for tp in partitions})
        for tp in partitions:
            at = found.get(tp)
            consumer.seek(tp, at.offset if at is not None else ends[tp])
        while True:
            batch = await consumer.getmany(timeout_ms=200)
            for tp, messages in batch.items():
                for m in messages:
                    yield record_of(tp.partition, m)


def record_of(partition: int, message: Any) -> Record:
    """An aiokafka ConsumerRecord as a `Record`, headers included (a stand-in for a record the
    client could not read says so)."""
    headers = tuple(message.headers or ())
    # (whether it is unreadable is asked only of a record without a value)
    if message.value is None and (why := kafka_records.unreadable(message.key, headers)) is not None:
        return Record(partition, message.offset, None, None, (), why, message.timestamp)
    return Record(partition, message.offset, message.key, message.value, headers, None, message.timestamp)
