"""The seam between the worker and the log it reads and appends to.

Two implementations share it: Kafka (aiokafka consumer group + idempotent producer) and
the embedded file log (one process, no broker). The worker cannot tell them apart.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Record:
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    # Record headers, as written (e.g. the publisher's W3C `traceparent`).
    headers: tuple[tuple[str, bytes], ...] = ()


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

    def __post_init__(self) -> None:
        if not self.snapshots:
            object.__setattr__(self, "snapshots", self.events.removesuffix(".events") + ".snapshots")


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
    async def on_assigned(self, partitions: dict[int, PartitionStart]) -> dict[int, int] | None:
        """Returns where to start reading each partition (left out: the beginning)."""
        ...

    async def on_revoked(self, partitions: set[int]) -> None: ...


class RecordRefused(ValueError):
    """The log will never accept this record as it is (too large for the topic, the topic
    invalid or not ours to write): retrying cannot help, unlike a broker that is away."""


AppendFn = Callable[[str, str, bytes, int | None], Awaitable[tuple[int, int]]]


class EventLog(Protocol):
    topics: Topics

    async def start(self, listener: RebalanceListener) -> None: ...

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

    def read_partition(self, topic: str, partition: int) -> AsyncIterator[list[Record]]:
        """The records of one partition of any topic, from its first to its end at the time
        of the call, a batch at a time, outside the consumer group (nothing is committed)."""
        ...

    async def flush(self) -> None:
        """Wait until every append in flight is on the log (or failed)."""
        ...

    async def stop(self) -> None: ...
