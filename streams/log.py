"""The seam between the log and everything that reads or appends to it.

Two implementations share it: Kafka (aiokafka consumer group + idempotent producer) and
the embedded file log (one process, no broker). Nothing above this seam -- the worker,
the scheduler, metrics, the HTTP API, the CLI -- can tell them apart: partitioning, end
offsets, a producer-only open, ownership and a reader in no group are all part of it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from turnstile.events.identity import partition_for as partition_for  # (where the log's users find it)


@dataclass(frozen=True, slots=True)
class Record:
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    # Record headers, as written (e.g. the publisher's W3C `traceparent`); a header's value
    # may be null on Kafka.
    headers: tuple[tuple[str, bytes | None], ...] = ()
    # Why the log's client could not read this record at all (`streams.kafka_records`): it
    # stands in for it, with no key or value.
    unreadable: str | None = None
    # When Kafka says the record was written (its timestamp, ms); None on the embedded log.
    timestamp_ms: int | None = None


@dataclass(frozen=True, slots=True)
class PartitionStart:
    """Where a newly assigned partition stands: replay runs from the beginning to
    `end_offset` before the worker decides anything; offsets below `committed` were
    already processed by some owner, so their one-time effects (dead letters, outcome
    records) are not repeated."""

    end_offset: int
    committed: int


@dataclass(frozen=True, slots=True)
class Topics:
    events: str = "turnstile.events"
    outcomes: str = "turnstile.outcomes"
    dead_letters: str = "turnstile.events.dlq"
    # Text of replies in progress, for live readers only: not the durable log, short retention.
    deltas: str = "turnstile.deltas"
    # Compacted, co-partitioned with `events`, keyed by conversation id (`streams/snapshots.py`).
    # By default named after the events topic: turnstile.events -> turnstile.snapshots.
    snapshots: str = ""
    # Compacted, co-partitioned, keyed by conversation id: per conversation a *head* (what its
    # latest snapshot covers, its status, and where that snapshot is on `snapshots`). A new
    # owner reads these, not the snapshots, to go live (`streams/snapshots.py`).
    # By default: turnstile.snapshots -> turnstile.snapshots.heads.
    heads: str = ""

    def __post_init__(self) -> None:
        if not self.snapshots:
            object.__setattr__(self, "snapshots", self.events.removesuffix(".events") + ".snapshots")
        if not self.heads:
            object.__setattr__(self, "heads", self.snapshots + ".heads")


class Acknowledged(Protocol):
    """Where an appended record landed (aiokafka's RecordMetadata is one)."""

    @property
    def partition(self) -> int: ...

    @property
    def offset(self) -> int: ...


@dataclass(frozen=True, slots=True)
class Landed:
    partition: int
    offset: int


class RebalanceListener(Protocol):
    async def on_assigned(self, partitions: dict[int, PartitionStart]) -> Mapping[int, int]:
        """Returns the offset to read each partition from (0: replay it whole); one left out
        is not read (the listener took nothing of it: it is stopping)."""
        ...

    async def on_revoked(self, partitions: set[int]) -> None: ...


# The producer refuses a record larger than this (aiokafka's default, set explicitly so the
# worker knows it); the broker's own limit per topic is `max.message.bytes`.
MAX_REQUEST_BYTES = 1 << 20
# Kafka's broker default for `max.message.bytes`: what a topic takes unless configured (and
# what the embedded log takes, so that what runs embedded runs on a default broker).
BROKER_DEFAULT_MAX_MESSAGE_BYTES = 1_048_588
# What a record batch of one record adds to its key and value: the batch header (61 bytes)
# and the record's own varints and attributes, rounded up.
LONE_RECORD_OVERHEAD_BYTES = 128


def value_limit(max_message_bytes: int, key: str | None) -> int:
    """The largest value a record with `key` may have, alone in its batch, on a topic that
    takes `max_message_bytes`, from a producer whose requests are `MAX_REQUEST_BYTES` at most."""
    return min(MAX_REQUEST_BYTES, max_message_bytes) - LONE_RECORD_OVERHEAD_BYTES - len((key or "").encode())


class RecordRefused(ValueError):
    """The log will never accept this record as it is (too large for the topic, the topic
    invalid or not ours to write): retrying cannot help, unlike a broker that is away."""


class ReadTooLarge(LookupError):
    """A bounded read would take more records than it may."""

    def __init__(self, partitions: list[int], records: int, limit: int) -> None:
        super().__init__(f"partitions {partitions} hold {records} records, more than a bounded read takes ({limit})")
        self.partitions, self.records, self.limit = partitions, records, limit


class LogOwned(RuntimeError):
    """Another process owns this log (the embedded log has one owner)."""


class LogReader(Protocol):
    """Reads topics in no consumer group: it commits nothing and disturbs no worker. For
    `tail`, `inspect`, `audit`, the HTTP views and tests that judge the log itself."""

    async def read(self, topic: str, timeout_s: float = 30.0) -> list[Record]:
        """Every record of `topic` up to its end at the time of the call, in partition order."""
        ...

    async def conversation(self, conversation_id: str, timeout_s: float = 30.0) -> list[Record]:
        """The events topic's records of the conversation's partition, up to its end now."""
        ...

    async def span(self, topic: str, partition: int, start: int, end: int, timeout_s: float = 30.0) -> list[Record]:
        """The records of one partition from offset `start` up to (not including) `end`."""
        ...

    async def tail(
        self, topic: str, partition: int, start: int, max_records: int | None = None, timeout_s: float = 30.0
    ) -> list[Record]:
        """The records of one partition from offset `start` up to its end at the time of the
        call; `ReadTooLarge` before reading any when they are more than `max_records`."""
        ...

    async def partition_of(self, conversation_id: str, timeout_s: float = 30.0) -> int:
        """The events partition the conversation's records are on (its key's)."""
        ...

    def follow(self, topic: str, since_ms: int) -> AsyncIterator[Record]:
        """The records of `topic` from `since_ms` (Unix ms, by record time) on, as they
        arrive, until cancelled. The embedded log keeps no record times and has one
        process: it follows from the end."""
        ...


AppendFn = Callable[[str, str, bytes, int | None], Awaitable[tuple[int, int]]]


class EventLog(Protocol):
    topics: Topics

    async def start(self, listener: RebalanceListener) -> None:
        """Consume the events topic (partitions come through `listener`) and append."""
        ...

    async def start_producer(self) -> None:
        """Append only: no consumer, no group, no ownership (a publisher, `send`, the
        operations commands). `stop` closes it."""
        ...

    def own(self) -> None:
        """Become the process that folds this log and writes its effects, or raise
        `LogOwned` naming the owner. `start` does it; a command may do it sooner, to refuse
        before it starts anything else. On Kafka the group decides: nothing to do."""
        ...

    def partition_count(self) -> int | None:
        """Partitions of the events topic; None while the log does not know yet (Kafka
        before its first metadata)."""
        ...

    def partition_for(self, key: str) -> int | None:
        """The events partition a record with this key lands in (None: not known yet)."""
        ...

    def end_offset(self, partition: int) -> int | None:
        """The last known end of an events partition this process consumes (None: unknown)."""
        ...

    async def read_position(self, partition: int) -> int | None:
        """The offset the consumer reads next in an events partition it consumes, past the
        offsets that hold no record for it (a transaction's commit or abort marker, records of
        an aborted transaction); None where every offset is a record or it is not known."""
        ...

    def reader(self) -> LogReader:
        """A reader of this log's topics in no group."""
        ...

    def take(self, positions: Mapping[int, int]) -> None:
        """Inside the listener's `on_assigned`: read these partitions of the assignment
        from these offsets from now on, before it returns (it may return them again)."""
        ...

    async def poll(self, timeout_s: float) -> list[Record]: ...

    async def append(
        self,
        topic: str,
        key: str | None,
        value: bytes,
        partition: int | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> tuple[int, int]:
        """Append and wait for the log to acknowledge; returns (partition, offset). Raises
        `RecordRefused` when the record can never be written."""
        ...

    def max_value_bytes(self, topic: str, key: str | None) -> int | None:
        """The largest value a record of `topic` with this key may have (None: no limit),
        from the log's own configuration once started."""
        ...

    async def send(
        self, topic: str, key: str, value: bytes, partition: int | None = None
    ) -> asyncio.Future[Acknowledged]:
        """Put the record in the log's order and return without waiting for the log to
        acknowledge it: the future resolves to where it landed once it does. Records sent
        to one partition land in the order they were sent."""
        ...

    async def commit(self, offsets: dict[int, int]) -> None: ...

    def read_partitions(
        self, topic: str, partitions: list[int], starts: Mapping[int, int] | None = None
    ) -> AsyncGenerator[list[Record], None]:
        """The records of these partitions of any topic, from their first (or the offset
        `starts` gives) to their end at the time of the call, outside the consumer group
        (nothing is committed). They come in chunks, each of one partition and in its
        order, so that a reader of a large topic holds one chunk at a time."""
        ...

    async def read_at(self, topic: str, partition: int, offsets: list[int]) -> dict[int, Record]:
        """The records at exactly these offsets of one partition of any topic, outside the
        consumer group; an offset with no record (compacted away, or past the end) is left
        out. For a few point reads: the states a new owner needs before it decides."""
        ...

    async def flush(self) -> None:
        """Wait until every append in flight is on the log (or failed)."""
        ...

    async def stop(self) -> None: ...
